package envoymsg

import (
	"testing"
)

func TestChunksCoverTheBodyWithEndOfStreamOnTheLast(t *testing.T) {
	for _, tt := range []struct {
		body string
		n    int
		eos  bool
		want []string
	}{
		{"abcdefg", 3, true, []string{"abc", "def", "g"}},
		{"abcdef", 2, false, []string{"abc", "def"}},
		{"ab", 5, true, []string{"a", "b"}},
		{"", 3, true, []string{""}},
	} {
		msgs := Chunks(Request, []byte(tt.body), tt.n, tt.eos)
		if len(msgs) != len(tt.want) {
			t.Fatalf("Chunks(%q, %d): %d messages, want %d", tt.body, tt.n, len(msgs), len(tt.want))
		}
		for i, m := range msgs {
			b := m.GetRequestBody()
			if string(b.GetBody()) != tt.want[i] {
				t.Errorf("Chunks(%q, %d)[%d] = %q, want %q", tt.body, tt.n, i, b.GetBody(), tt.want[i])
			}
			if wantEOS := tt.eos && i == len(msgs)-1; b.GetEndOfStream() != wantEOS {
				t.Errorf("Chunks(%q, %d)[%d] end_of_stream %v, want %v", tt.body, tt.n, i, b.GetEndOfStream(), wantEOS)
			}
		}
	}
}

func TestMessagesBelongToTheirDirection(t *testing.T) {
	if Headers(Response, true).GetResponseHeaders() == nil || Headers(Request, true).GetRequestHeaders() == nil {
		t.Error("Headers put the message in the wrong direction")
	}
	if Body(Response, nil, true).GetResponseBody() == nil || Body(Request, nil, true).GetRequestBody() == nil {
		t.Error("Body put the message in the wrong direction")
	}
	if Trailers(Response).GetResponseTrailers() == nil || Trailers(Request).GetRequestTrailers() == nil {
		t.Error("Trailers put the message in the wrong direction")
	}
	h := Headers(Request, false, Header{"x-a", "1"}).GetRequestHeaders().GetHeaders().GetHeaders()[0]
	if string(h.GetRawValue()) != "1" || h.GetValue() != "" {
		t.Errorf("header value %q / raw %q: Envoy sends raw_value only", h.GetValue(), h.GetRawValue())
	}
}
