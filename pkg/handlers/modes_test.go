package handlers_test

// The real pipeline behind the phases, driven without gRPC: what reaches the
// engines and Envoy for each connector and body mode.

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

var roomRE = regexp.MustCompile(`"bootstrap_room":\d+`)

// pinRoom replaces the random SGLang room so bodies can be compared exactly.
func pinRoom(s string) string { return roomRE.ReplaceAllString(s, `"bootstrap_room":ROOM`) }

func TestFullDuplexRoutesWithHeldHeadersAndStreamedBody(t *testing.T) {
	longChat := `{"model":"m","messages":[` + strings.Repeat(`{"role":"user","content":"r\u00e9sum\u00e9 \"café\" 東京\n"},`, 3000) +
		`{"role":"user","content":"end"}],"max_tokens":5,"seed":98765432109876543210}`
	tests := []struct {
		connector   string
		body        string
		chunks      int
		wantPrefill string // "" when a leg is not pinned
		wantDecode  string
	}{
		{
			connector: "kv-nixl", body: clientChat, chunks: 3,
			wantPrefill: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"max_tokens":1,"seed":12345678901234567890,` +
				`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null},"min_tokens":1}`,
			wantDecode: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_tokens":50,"seed":12345678901234567890,"kv_transfer_params":` + nixlParams + `}`,
		},
		{
			connector: "kv-shared-storage", body: clientChat, chunks: 2,
			wantPrefill: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":false,"max_tokens":1,"seed":12345678901234567890,"min_tokens":1}`,
			wantDecode: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_tokens":50,"seed":12345678901234567890}`,
		},
		{
			connector: "kv-sglang", body: clientChat, chunks: 1,
			wantPrefill: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_tokens":50,"seed":12345678901234567890,"bootstrap_room":ROOM,"bootstrap_host":"127.0.0.1","bootstrap_port":8998}`,
			wantDecode: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_tokens":50,"seed":12345678901234567890,"bootstrap_room":ROOM,"bootstrap_host":"127.0.0.1","bootstrap_port":8998}`,
		},
		{
			// A long conversation cut anywhere (inside strings, escapes, UTF-8
			// sequences): it is validated as it arrives, and reaches decode intact.
			connector: "kv-nixl", chunks: 9, body: longChat,
			wantDecode: strings.TrimSuffix(longChat, "}") + `,"kv_transfer_params":` + nixlParams + `}`,
		},
		{
			connector: "kv-nixl", chunks: 7, // a long prompt: the decode body comes back in ≤ 62,000-byte chunks
			body:       `{"model":"m","prompt":"` + strings.Repeat("a", 200_000) + `"}`,
			wantDecode: `{"model":"m","prompt":"` + strings.Repeat("a", 200_000) + `","kv_transfer_params":` + nixlParams + `}`,
		},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s/%d-bytes/%d-chunks", tt.connector, len(tt.body), tt.chunks), func(t *testing.T) {
			prefill := enginetest.Start(t, prefillOK)
			decode := enginetest.Start(t, enginetest.JSON(200, `{}`))
			s := newServer(t, fmt.Sprintf(`
connector: %s
pools: {prefill: {endpoints: [%q]}, decode: {endpoints: [%q]}}`, tt.connector, prefill.Addr(), decode.Addr()), handlers.Options{})

			path := chatPath
			if !strings.Contains(tt.body, "messages") {
				path = "/v1/completions"
			}
			msgs := append([]*extprocv3.ProcessingRequest{envoymsg.WithModes(
				envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(path, len(tt.body), envoymsg.Header{"x-request-id", "req-1"})...),
				fullDuplex, fullDuplex)},
				envoymsg.Chunks(envoymsg.Request, []byte(tt.body), tt.chunks, true)...)
			replies := drive(t, s, msgs...)

			hr := replies[0].GetRequestHeaders().GetResponse()
			if hr == nil {
				t.Fatalf("first reply is not the request headers reply: %v", replies[0])
			}
			if got, _ := headerValue(hr.GetHeaderMutation(), "x-gateway-destination-endpoint"); got != decode.Addr() {
				t.Errorf("destination header = %q, want %q", got, decode.Addr())
			}
			if got := metadataDestination(replies[0]); got != decode.Addr() {
				t.Errorf("envoy.lb metadata = %q, want %q", got, decode.Addr())
			}
			if got, _ := headerValue(hr.GetHeaderMutation(), "x-request-id"); got != "req-1" {
				t.Errorf("x-request-id = %q, want the client's req-1", got)
			}
			if !hr.GetClearRouteCache() {
				t.Error("clear_route_cache not set")
			}
			if got := pinRoom(streamedBody(t, replies[1:], false)); got != tt.wantDecode {
				t.Errorf("decode body:\n got %.300s\nwant %.300s", got, tt.wantDecode)
			}
			if n := len(tt.body) / 62000; len(replies)-1 < n+1 {
				t.Errorf("%d body replies for a %d-byte body", len(replies)-1, len(tt.body))
			}

			if tt.connector == "kv-sglang" {
				prefill.Await(t) // the leg runs in the background
			}
			legs := prefill.Requests()
			if len(legs) != 1 || legs[0].Header.Get("X-Request-Id") != "req-1" {
				t.Fatalf("prefill engine got %d requests (%v), want 1 with X-Request-Id req-1", len(legs), legs)
			}
			if tt.wantPrefill != "" && pinRoom(legs[0].Body) != tt.wantPrefill {
				t.Errorf("prefill body:\n got %s\nwant %s", legs[0].Body, tt.wantPrefill)
			}
			if tt.connector == "kv-sglang" && roomRE.FindString(legs[0].Body) != roomRE.FindString(streamedBody(t, replies[1:], false)) {
				t.Error("prefill and decode legs carry different bootstrap rooms")
			}
			if got := decode.Requests(); len(got) != 0 {
				t.Errorf("the service itself sent %d requests to the decode engine; Envoy must", len(got))
			}
		})
	}
}

func TestBufferedCarriesRoutingAndContentLengthInBodyReply(t *testing.T) {
	// A decode-only request whose body needs no change: Envoy forwards its own copy.
	const plainChat = `{"model":"m","messages":[{"role":"user","content":"hi"}],"seed":12345678901234567890}`
	tests := []struct {
		name              string
		prefill           bool
		body              string
		withContentLength bool
		wantBody          string // the body mutation; "" for none
	}{
		{"P/D, content-length sent", true, clientChat, true, "params"},
		{"P/D, chunked request", true, clientChat, false, "params"},
		{"decode-only, nothing to change: no body sent back", false, plainChat, true, ""},
		{"decode-only, client's transfer fields removed", false, clientChat, true,
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
				`"max_tokens":50,"seed":12345678901234567890}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefill := `[]`
			if tt.prefill {
				prefill = fmt.Sprintf("[%q]", enginetest.Start(t, prefillOK).Addr())
			}
			s := newServer(t, fmt.Sprintf(`
connector: kv-nixl
pools: {prefill: {endpoints: %s}, decode: {endpoints: ["10.1.1.1:8000"]}}`, prefill), handlers.Options{})
			hs := envoymsg.Post(chatPath, len(tt.body))
			if !tt.withContentLength {
				hs = slices.DeleteFunc(hs, func(h envoymsg.Header) bool { return h[0] == "content-length" })
			}
			replies := drive(t, s, envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, hs...), buffered, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(tt.body), true))
			if len(replies) != 2 {
				t.Fatalf("got %d replies, want headers then body: %v", len(replies), replies)
			}
			if m := replies[0].GetRequestHeaders().GetResponse().GetHeaderMutation(); len(m.GetSetHeaders()) != 0 ||
				!slices.Equal(m.GetRemoveHeaders(), []string{handlers.DestinationHeader}) {
				t.Errorf("BUFFERED headers reply must only remove %s, got mutation %v", handlers.DestinationHeader, m)
			}
			br := replies[1].GetRequestBody().GetResponse()
			newBody := br.GetBodyMutation().GetBody()
			switch {
			case tt.wantBody == "params" && !strings.Contains(string(newBody), `"kv_transfer_params":`+nixlParams):
				t.Errorf("decode body lacks the prefill's params: %s", newBody)
			case tt.wantBody == "" && br.GetBodyMutation() != nil:
				t.Errorf("unchanged body sent back as a mutation: %v", br.GetBodyMutation())
			case tt.wantBody != "" && tt.wantBody != "params" && string(newBody) != tt.wantBody:
				t.Errorf("decode body\n%s\nwant\n%s", newBody, tt.wantBody)
			}
			if got, _ := headerValue(br.GetHeaderMutation(), "x-gateway-destination-endpoint"); got != "10.1.1.1:8000" {
				t.Errorf("destination = %q", got)
			}
			if got := metadataDestination(replies[1]); got != "10.1.1.1:8000" {
				t.Errorf("metadata destination = %q", got)
			}
			cl, ok := headerValue(br.GetHeaderMutation(), "content-length")
			switch {
			case tt.wantBody == "" && ok:
				t.Errorf("content-length %q set for a body left as the client sent it", cl)
			case tt.wantBody != "" && tt.withContentLength && cl != fmt.Sprint(len(newBody)):
				t.Errorf("content-length = %q, want %d (Envoy answers 500 on a mismatch)", cl, len(newBody))
			case !tt.withContentLength && ok:
				t.Errorf("content-length %q set on a chunked request", cl)
			}
		})
	}
}

func TestSubsetHintRestrictsTheDecodeEndpoint(t *testing.T) {
	tests := []struct {
		name       string
		hint       *structpb.Value // nil: no hint
		wantDest   string
		wantStatus int // 503 when the hint allows nothing
	}{
		{"no hint", nil, "", 0},
		{"list naming one endpoint", structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewStringValue("10.1.1.2:8000")}}), "10.1.1.2:8000", 0},
		{"comma-separated string", structpb.NewStringValue("10.9.9.9:1, 10.1.1.1:8000"), "10.1.1.1:8000", 0},
		{"empty list", structpb.NewListValue(&structpb.ListValue{}), "", 503},
		{"only unknown endpoints", structpb.NewStringValue("10.9.9.9:1"), "", 503},
		// A hint we cannot read must not widen the choice.
		{"a list with a number in it", structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{
			structpb.NewStringValue("10.1.1.1:8000"), structpb.NewNumberValue(7)}}), "", 503},
		{"a number", structpb.NewNumberValue(42), "", 503},
		{"null", structpb.NewNullValue(), "", 503},
		{"an object", structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{"10.1.1.1:8000": structpb.NewBoolValue(true)}}), "", 503},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newServer(t, `{connector: kv-nixl, pools: {decode: {endpoints: ["10.1.1.1:8000", "10.1.1.2:8000"]}}}`, handlers.Options{})
			msg := envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, true, envoymsg.Header{":method", "GET"}, envoymsg.Header{":path", "/v1/models"}),
				fullDuplex, fullDuplex)
			if tt.hint != nil {
				msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
					"envoy.lb.subset_hint": {Fields: map[string]*structpb.Value{"x-gateway-destination-endpoint-subset": tt.hint}},
				}}
			}
			replies := drive(t, s, msg)
			if tt.wantStatus != 0 {
				if status, _ := immediateOf(t, replies); status != tt.wantStatus {
					t.Errorf("status = %d, want %d", status, tt.wantStatus)
				}
				return
			}
			got, _ := headerValue(replies[0].GetRequestHeaders().GetResponse().GetHeaderMutation(), "x-gateway-destination-endpoint")
			if tt.wantDest != "" && got != tt.wantDest {
				t.Errorf("destination = %q, want %q", got, tt.wantDest)
			}
			if got == "" {
				t.Error("no destination")
			}
		})
	}
}
