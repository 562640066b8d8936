package response

import (
	"strings"
	"testing"
)

// The WHATWG server-sent events framing a client reads: lines end in CRLF,
// LF or CR; a blank line ends an event; "data:" with or without one space;
// comment lines (":") and other fields are not data; one byte order mark at
// the stream's start is skipped. Each stream is fed cut at every position
// (and once whole): the rewriter's bytes, the reader's number and the
// opening's verdict must not depend on the cut.
func TestEventStreamFramingAsAClientReadsIt(t *testing.T) {
	const bom = "\ufeff"
	crlf := func(s string) string { return strings.ReplaceAll(s, "\n", "\r\n") }
	cr := func(s string) string { return strings.ReplaceAll(s, "\n", "\r") }
	noSpace := func(s string) string { return strings.ReplaceAll(s, "data: ", "data:") }
	comment := ": \"cached_tokens\":12 ping\n"
	// split cuts an event's data in two lines, which a client joins with LF.
	split := func(ev, at, lead string) string { return strings.Replace(ev, at, at+"\n"+lead, 1) }
	tests := []struct {
		name, in, want string
		read           string  // what a reader reads of the number; "" for nothing
		verdict        Verdict // of NewOpening(1, 1)
	}{
		{"LF", role + tok0 + usageEv + done, role + tok0 + fixedEv + done, "12", Served},
		{"CRLF", crlf(role + tok0 + usageEv + done), crlf(role + tok0 + fixedEv + done), "12", Served},
		{"CR", cr(role + tok0 + usageEv + done), cr(role + tok0 + fixedEv + done), "12", Served},
		{"mixed line ends", role + crlf(tok0) + cr(usageEv) + done, role + crlf(tok0) + cr(fixedEv) + done, "12", Served},
		{"data: without its space", noSpace(role + tok0 + usageEv + done), noSpace(role + tok0 + fixedEv + done), "12", Served},
		{"comments and other fields", comment + "event: x\n" + role + comment + tok0 + "id: 3\n" + comment + usageEv + done,
			comment + "event: x\n" + role + comment + tok0 + "id: 3\n" + comment + fixedEv + done, "12", Served},
		{"a leading BOM", bom + usageEv + done, bom + fixedEv + done, "12", Served},
		{"a leading BOM, then an error event", bom + errorEv + done, bom + errorEv + done, "", Failed},
		{"a leading BOM, CRLF", crlf(bom + role + tok0 + usageEv), crlf(bom + role + tok0 + fixedEv), "12", Served},
		{"a usage event on two data lines", role + split(usageEv, `"choices":[],`, "data: ") + done,
			role + split(fixedEv, `"choices":[],`, "data: ") + done, "12", Served},
		{"a usage event on three data lines, CRLF", crlf(role + split(split(usageEv, `"choices":[],`, "data: "), `"prompt_tokens_details":`, "data:") + done),
			crlf(role + split(split(fixedEv, `"choices":[],`, "data: "), `"prompt_tokens_details":`, "data:") + done), "12", Served},
		{"usage, then an error event on two data lines: the reader reads nothing", tok0 + usageEv + split(errorEv, `{"error":`, "data: ") + done,
			tok0 + fixedEv + split(errorEv, `{"error":`, "data: ") + done, "", Served},
		{"an error event on two data lines", "data: {\"error\":\ndata: {\"code\":503}}\n\n" + done, "data: {\"error\":\ndata: {\"code\":503}}\n\n" + done, "", Failed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for cut := 0; cut <= len(tt.in); cut++ {
				chunks := []string{tt.in[:cut], tt.in[cut:]}
				w := New(chatPath, []byte("8"), nil, 1<<20)
				w.Start(200, "text/event-stream", "")
				var read string
				rd := NewReader(chatPath, 1<<20, func(raw []byte, stated bool) {
					if stated {
						read = string(raw)
					}
				})
				rd.Start(200, "text/event-stream", "")
				var got strings.Builder
				o := NewOpening(1, 1)
				for i, c := range chunks {
					for _, piece := range w.Body([]byte(c), i == len(chunks)-1) {
						got.Write(piece)
					}
					rd.Body([]byte(c), i == len(chunks)-1)
					o.Scan([]byte(c))
				}
				if got.String() != tt.want {
					t.Fatalf("cut at %d: the client gets\n%q\nwant\n%q", cut, got.String(), tt.want)
				}
				if read != tt.read {
					t.Fatalf("cut at %d: the reader read %q, want %q", cut, read, tt.read)
				}
				if o.Verdict() != tt.verdict {
					t.Fatalf("cut at %d: verdict %v, want %v", cut, o.Verdict(), tt.verdict)
				}
			}
		})
	}
}
