package handlers_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"google.golang.org/grpc"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/response"
)

// benchFrame is the size of the data frames Envoy forwards a FULL_DUPLEX body
// in: HTTP/2's default maximum frame.
const benchFrame = 16 << 10

// BenchmarkProcess drives one request per operation through Process and the
// real pipeline, as Envoy sends it, over an in-memory stream: no gRPC, so that
// what is measured is the request path of this package and the pipeline. P/D
// sends a real prefill leg to an in-process engine on loopback.
func BenchmarkProcess(b *testing.B) {
	modes := []struct {
		name string
		mode filterv3.ProcessingMode_BodySendMode
	}{{"full_duplex", filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}, {"buffered", filterv3.ProcessingMode_BUFFERED}}
	sizes := []struct {
		name string
		n    int
	}{{"4KiB", 4 << 10}, {"256KiB", 256 << 10}}
	for _, m := range modes {
		for _, size := range sizes {
			for _, pd := range []string{"pd", "decode_only"} {
				b.Run(fmt.Sprintf("mode=%s/body=%s/route=%s", m.name, size.name, pd), func(b *testing.B) {
					benchProcess(b, m.mode, size.n, pd == "pd")
				})
			}
		}
	}
}

func benchProcess(b *testing.B, mode filterv3.ProcessingMode_BodySendMode, n int, pd bool) {
	prefill := `[]`
	pdMode := config.PDNever
	if pd {
		prefill = fmt.Sprintf("[%q]", benchPrefillEngine(b))
		pdMode = config.PDAlways
	}
	cfg, err := config.Parse(fmt.Appendf(nil, `connector: kv-nixl
pd: {mode: %s}
pools: {prefill: {endpoints: %s}, decode: {endpoints: ["10.1.1.1:8000"]}}`, pdMode, prefill))
	if err != nil {
		b.Fatal(err)
	}
	s := handlers.NewServer(assembled(b, cfg), handlers.Options{
		OverrideAfter:    cfg.Envoy.OverrideAfter.D(),
		OverrideTimeout:  cfg.Envoy.OverrideMessageTimeout.D(),
		MaxStreams:       cfg.Limits.MaxConcurrentStreams,
		RetryAfter:       cfg.Limits.RetryAfter.D(),
		BodyTimeout:      cfg.Limits.BodyTimeout.D(),
		MaxBufferedBytes: cfg.Limits.MaxBufferedBytes,
	}, logr.Discard())

	body := benchChat(n)
	msgs := []*extprocv3.ProcessingRequest{envoymsg.WithModes(
		envoymsg.Headers(envoymsg.Request, false, envoymsg.Post("/v1/chat/completions", len(body))...),
		mode, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)}
	if mode == filterv3.ProcessingMode_BUFFERED {
		msgs = append(msgs, envoymsg.Body(envoymsg.Request, body, true))
	} else {
		msgs = append(msgs, envoymsg.ChunksOf(envoymsg.Request, body, benchFrame, true)...)
	}

	// One request first, checked, so that a benchmark that stopped routing
	// (or stopped sending the prefill leg) fails instead of getting faster.
	st := &benchStream{ctx: context.Background(), msgs: msgs, keep: true}
	if err := s.Process(st); err != nil {
		b.Fatal(err)
	}
	benchCheck(b, st.sent, pd)

	b.ReportAllocs()
	b.SetBytes(int64(n))
	b.ResetTimer()
	for b.Loop() {
		st.reset()
		if err := s.Process(st); err != nil {
			b.Fatal(err)
		}
	}
}

// benchCheck fails the benchmark unless the request was routed, with the
// prefill's transfer parameters in the decode body for P/D.
func benchCheck(b *testing.B, replies []*extprocv3.ProcessingResponse, pd bool) {
	b.Helper()
	var decode []byte
	routed := false
	for _, r := range replies {
		if r.GetImmediateResponse() != nil {
			b.Fatalf("the request was refused: %v", r.GetImmediateResponse())
		}
		common := r.GetRequestHeaders().GetResponse()
		if common == nil {
			common = r.GetRequestBody().GetResponse()
		}
		for _, h := range common.GetHeaderMutation().GetSetHeaders() {
			routed = routed || h.GetHeader().GetKey() == handlers.DestinationHeader
		}
		decode = append(decode, common.GetBodyMutation().GetStreamedResponse().GetBody()...)
		decode = append(decode, common.GetBodyMutation().GetBody()...)
	}
	if !routed {
		b.Fatalf("no routing in the replies: %v", replies)
	}
	if got := bytes.Contains(decode, []byte(`"kv_transfer_params":{"do_remote_prefill":true`)); got != pd {
		b.Fatalf("decode body has the prefill's transfer parameters: %v, want %v", got, pd)
	}
}

// benchChat is a chat request of about n bytes.
func benchChat(n int) []byte {
	const head, tail = `{"model":"m","messages":[{"role":"user","content":"`, `"}],"max_tokens":50,"stream":true}`
	words := strings.Repeat("the quick brown fox jumps over the lazy dog, ", n/45+1)
	return []byte(head + words[:max(n-len(head)-len(tail), 1)] + tail)
}

// benchPrefillEngine answers every prefill leg as a vLLM NIXL prefill does,
// reading the whole leg first, and returns its ip:port.
func benchPrefillEngine(b *testing.B) string {
	const answer = `{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,` +
		`"do_remote_decode":false,"remote_block_ids":[[1,2],[3]],"remote_engine_id":"e-1","remote_host":"10.0.0.9","remote_port":5600}}`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	}))
	b.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// benchStream is the server side of one Process stream in memory: it hands out
// msgs, then EOF as a half-close, and counts the replies (keeping them when
// keep is set).
type benchStream struct {
	grpc.ServerStream
	ctx     context.Context
	msgs    []*extprocv3.ProcessingRequest
	next    int
	replies int
	keep    bool
	sent    []*extprocv3.ProcessingResponse
}

func (s *benchStream) reset() { s.next, s.replies, s.keep, s.sent = 0, 0, false, nil }

func (s *benchStream) Context() context.Context { return s.ctx }

func (s *benchStream) Recv() (*extprocv3.ProcessingRequest, error) {
	if s.next == len(s.msgs) {
		return nil, io.EOF
	}
	s.next++
	return s.msgs[s.next-1], nil
}

func (s *benchStream) Send(r *extprocv3.ProcessingResponse) error {
	s.replies++
	if s.keep {
		s.sent = append(s.sent, r)
	}
	return nil
}

// BenchmarkResponseChunk is the handlers' cost of one streamed token event of
// an answer, passed through or read by a usage rewrite, without gRPC (the
// replies go to a sink that drops them).
func BenchmarkResponseChunk(b *testing.B) {
	tok := []byte("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\"," +
		"\"choices\":[{\"index\":0,\"delta\":{\"content\":\" token\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n")
	for _, rewrite := range []bool{false, true} {
		b.Run(fmt.Sprintf("rewrite=%v", rewrite), func(b *testing.B) {
			r := &fakeRouter{}
			if rewrite {
				r.rewrite = func() *response.Rewriter {
					return response.New(response.Paths{JSON: api.Chat.Shape.CachedTokens}, []byte("8"), nil, 1<<20)
				}
			}
			x := handlers.NewServer(r, handlers.Options{}, logr.Discard()).Open(b.Context(), discard{})
			defer x.Close()
			for _, m := range []*extprocv3.ProcessingRequest{
				envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), fullDuplex, fullDuplex),
				envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
				envoymsg.Headers(envoymsg.Response, false, envoymsg.Header{":status", "200"}, envoymsg.Header{"content-type", "text/event-stream"}),
			} {
				x.Handle(m)
			}
			chunk := envoymsg.Body(envoymsg.Response, tok, false)
			b.ReportAllocs()
			for b.Loop() {
				x.Handle(chunk)
			}
		})
	}
}

type discard struct{}

func (discard) Send(*extprocv3.ProcessingResponse) error { return nil }
