package handlers_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"
	"weak"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
)

// heldBody is the size of the client's body and of the prefill engine's
// answer in TestHeldStreamsLetGoOfTheRequest: far above what an exchange
// may keep of its own, so that keeping either shows.
const heldBody = 64 << 10

// maxHeldBytes is what a routed exchange may still hold while its answer
// streams: the exchange, its decision, the rewrite of the answer, the
// request's headers and what gRPC would keep of the stream is not part of it.
// About 2 KiB are held (3 under the race detector); a body or prefill answer kept
// would add 64 KiB or more.
const maxHeldBytes = 12 << 10

// A generation holds its ext_proc stream to its last token when Envoy sends
// the response path (the shipped envoy.yaml), so what a routed request keeps
// is kept that long, for every stream held (docs/benchmarks.md, Held
// streams). Once the routing reply, and in FULL_DUPLEX the last body chunk,
// is sent, neither the client's body nor the prefill engine's answer nor what
// was parsed of them may stay reachable from the exchange.
func TestHeldStreamsLetGoOfTheRequest(t *testing.T) {
	prefill := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, bigPrefillAnswer())
	}))
	t.Cleanup(prefill.Close)
	addr := strings.TrimPrefix(prefill.URL, "http://")

	tests := []struct {
		name    string
		pd      bool
		mode    filterv3.ProcessingMode_BodySendMode
		chunked bool // FULL_DUPLEX in 16 KiB chunks, collected in a pooled buffer
	}{
		{"decode-only FULL_DUPLEX", false, fullDuplex, false},
		{"decode-only FULL_DUPLEX chunked", false, fullDuplex, true},
		{"decode-only BUFFERED", false, buffered, false},
		{"P/D FULL_DUPLEX", true, fullDuplex, false},
		{"P/D FULL_DUPLEX chunked", true, fullDuplex, true},
		{"P/D BUFFERED", true, buffered, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pdMode, prefills := "never", "[]"
			if tt.pd {
				pdMode, prefills = "always", fmt.Sprintf("[%q]", addr)
			}
			s := newServer(t, fmt.Sprintf(`connector: kv-nixl
pd: {mode: %s}
response: {rewrite_usage: true}
pools: {prefill: {endpoints: %s}, decode: {endpoints: ["10.1.1.1:8000"]}}`, pdMode, prefills), handlers.Options{})
			const n = 16
			held := make([]*handlers.Exchange, n)
			bodies := make([]weak.Pointer[byte], n)
			var before, after runtime.MemStats
			runtime.GC() // twice: pooled buffers of earlier tests survive one collection
			runtime.GC()
			runtime.ReadMemStats(&before)
			for i := range held {
				held[i], bodies[i] = openRouted(t, s, tt.mode, tt.chunked)
			}
			runtime.GC()
			runtime.ReadMemStats(&after)
			kept := 0
			for _, b := range bodies {
				if b.Value() != nil {
					kept++
				}
			}
			for _, x := range held {
				x.Close()
			}

			if kept > 0 {
				t.Errorf("%d of %d client bodies still reachable while their routed streams are held", kept, n)
			}
			per := (int64(after.HeapAlloc) - int64(before.HeapAlloc)) / n
			t.Logf("%d bytes of heap per routed stream held", per)
			if per > maxHeldBytes {
				t.Errorf("each routed stream held holds %d bytes of heap, want at most %d (the body and the prefill answer are %d each)",
					per, maxHeldBytes, heldBody)
			}
		})
	}
}

// openRouted opens an exchange of s and routes a heldBody-byte chat request
// on it, then passes it the decode engine's response headers, as Envoy does
// before the answer's first token: the exchange is left as a held stream is.
// It returns a weak pointer to the client's body as gRPC would have decoded
// it (the first chunk's, when chunked). The messages are not kept.
func openRouted(t *testing.T, s *handlers.Server, mode filterv3.ProcessingMode_BodySendMode, chunked bool) (*handlers.Exchange, weak.Pointer[byte]) {
	t.Helper()
	client := []byte(heldChat())
	wp := weak.Make(&client[0])
	var msgs []*extprocv3.ProcessingRequest
	msgs = append(msgs, envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(client))...), mode, fullDuplex))
	if chunked {
		for i := 0; i < len(client); i += 16 << 10 {
			end := min(i+16<<10, len(client))
			msgs = append(msgs, envoymsg.Body(envoymsg.Request, client[i:end], end == len(client)))
		}
	} else {
		msgs = append(msgs, envoymsg.Body(envoymsg.Request, client, true))
	}
	msgs = append(msgs, envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "text/event-stream"}))
	client = nil

	out := &routedSink{}
	x := s.Open(t.Context(), out)
	for _, msg := range msgs {
		if done, err := x.Handle(msg); done || err != nil {
			t.Fatalf("the exchange ended (err %v) after %d replies", err, out.replies)
		}
	}
	if out.endpoint != "10.1.1.1:8000" {
		t.Fatalf("routed to %q after %d replies, want 10.1.1.1:8000", out.endpoint, out.replies)
	}
	return x, wp
}

// routedSink counts the replies and reads the routing from them, keeping none.
type routedSink struct {
	replies  int
	endpoint string
}

func (r *routedSink) Send(m *extprocv3.ProcessingResponse) error {
	r.replies++
	if e := metadataDestination(m); e != "" {
		r.endpoint = e
	}
	return nil
}

// heldChat is a chat request of heldBody bytes, a new string each call.
func heldChat() string {
	const head, tail = `{"model":"m","messages":[{"role":"user","content":"`, `"}],"stream":true}`
	return head + strings.Repeat("a", heldBody-len(head)-len(tail)) + tail
}

// bigPrefillAnswer is a vLLM prefill answer of about heldBody bytes: most of
// it in kv_transfer_params (which the decode body is spliced from), and the
// cached tokens the usage rewrite takes.
func bigPrefillAnswer() string {
	ids := strings.Repeat("1234567,", heldBody/8)
	return `{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,` +
		`"remote_block_ids":[` + ids + `0],"remote_engine_id":"e-1","remote_host":"10.0.0.9","remote_port":5600},` +
		`"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":7}}}`
}
