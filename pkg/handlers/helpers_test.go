package handlers_test

import (
	"context"
	"encoding/json"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/response"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	fullDuplex = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	buffered   = filterv3.ProcessingMode_BUFFERED
	chatPath   = "/v1/chat/completions"
)

// nixlParams is what a current vLLM prefill returns: nested lists, keys we do not
// know, and an integer too large for a float64 — all must reach decode unchanged.
const nixlParams = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2],[3]],` +
	`"remote_engine_id":"e-1","remote_request_id":"chatcmpl-r1-0a1b2c3d","remote_host":"10.0.0.9","remote_port":5600,` +
	`"tp_size":1,"future_key":{"n":12345678901234567890}}`

var prefillOK = enginetest.JSON(200, `{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":`+nixlParams+`}`)

// clientChat carries fields a client must not be able to set (kv_transfer_params,
// bootstrap_room) and a 20-digit seed that must keep every digit.
const clientChat = `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,` +
	`"stream_options":{"include_usage":true},"max_tokens":50,"seed":12345678901234567890,` +
	`"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil"},"bootstrap_room":"x"}`

// sendChatIn hands x clientChat's request headers (their processing mode
// overridden to mode) and body, as Envoy sends them, up to the first reply
// that does not go out, whose error it returns.
func sendChatIn(x *handlers.Exchange, mode filterv3.ProcessingMode_BodySendMode) error {
	for _, m := range []*extprocv3.ProcessingRequest{
		envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), mode, fullDuplex),
		envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
	} {
		if _, err := x.Handle(m); err != nil {
			return err
		}
	}
	return nil
}

// --- servers ---

// newPipeline is the real pipeline for yaml, waited for when the test ends.
func newPipeline(t *testing.T, yaml string, opts ...pipeline.Option) *pipeline.Pipeline {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return assembled(t, cfg, opts...)
}

// assembled is the real pipeline for cfg, waited for when the test ends.
func assembled(t testing.TB, cfg *config.Config, opts ...pipeline.Option) *pipeline.Pipeline {
	t.Helper()
	p, err := assemble.Pipeline(cfg, logr.Discard(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Wait)
	return p
}

// newServer is the handlers' server routing with the real pipeline for yaml.
func newServer(t *testing.T, yaml string, opts handlers.Options) *handlers.Server {
	t.Helper()
	return handlers.NewServer(newPipeline(t, yaml), opts, logr.Discard())
}

// startServer serves s over an in-memory gRPC connection and returns a client.
func startServer(t *testing.T, s *handlers.Server) extprocv3.ExternalProcessorClient {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, s)
	go srv.Serve(lis)
	conn, err := grpc.NewClient("passthrough:///bufconn", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
	})
	return extprocv3.NewExternalProcessorClient(conn)
}

// --- driving the phases without gRPC ---

// fakeEndpoint is where fakeRouter sends every request.
const fakeEndpoint = "10.1.1.1:8000"

// fakeRouter routes every request to fakeEndpoint and records what it was asked.
type fakeRouter struct {
	limit int64 // MaxBodyBytes; 0 means 1 MiB
	// decode gives the decode leg's body for the client's; nil passes the
	// client's body on untouched.
	decode func(client []byte) body.Spliced
	err    error         // returned instead of a decision
	block  chan struct{} // when set, Route waits for it to close
	// rewrite, when set, gives each decision a rewrite of the response.
	rewrite func() *response.Rewriter
	// legFailed, when set, is each decision's concurrent prefill leg.
	legFailed chan *pipeline.Error
	// answer, when set, is what RouteHeaders answers with instead of routing
	// (Decision.Answer).
	answer []byte

	calls []string           // "Route" or "RouteHeaders", in order
	seen  []pipeline.Request // the request of each call, as it was then
}

func (f *fakeRouter) MaxBodyBytes() int64 {
	if f.limit == 0 {
		return 1 << 20
	}
	return f.limit
}

func (f *fakeRouter) RouteHeaders(r *pipeline.Request) (*pipeline.Decision, error) {
	f.calls, f.seen = append(f.calls, "RouteHeaders"), append(f.seen, *r)
	if f.err != nil {
		return nil, f.err
	}
	if f.answer != nil {
		return &pipeline.Decision{Answer: f.answer}, nil
	}
	return &pipeline.Decision{Endpoints: []string{fakeEndpoint}}, nil
}

func (f *fakeRouter) Route(ctx context.Context, r *pipeline.Request) (*pipeline.Decision, error) {
	f.calls, f.seen = append(f.calls, "Route"), append(f.seen, *r)
	if f.block != nil {
		select {
		case <-f.block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if f.err != nil {
		return nil, f.err
	}
	d := &pipeline.Decision{Endpoints: []string{fakeEndpoint}, Body: body.Spliced{r.Body}}
	if f.decode != nil {
		d.Body = f.decode(r.Body)
	}
	if f.rewrite != nil {
		d.Rewrite = f.rewrite()
	}
	if f.legFailed != nil {
		d.LegFailed = f.legFailed
	}
	return d, nil
}

// recorder is the sink of an exchange driven without gRPC. It keeps each reply
// as the client receives it, marshalled and read back as gRPC sends it: a
// reply that cannot go on the wire fails its Send, and a reply is kept as it
// was when sent.
type recorder struct {
	mu      sync.Mutex
	replies []*extprocv3.ProcessingResponse
	changed chan struct{} // closed at the next reply
}

func newRecorder() *recorder { return &recorder{changed: make(chan struct{})} }

func (r *recorder) Send(m *extprocv3.ProcessingResponse) error {
	b, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	sent := &extprocv3.ProcessingResponse{}
	if err := proto.Unmarshal(b, sent); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.replies = append(r.replies, sent)
	close(r.changed)
	r.changed = make(chan struct{})
	return nil
}

// all returns the replies so far.
func (r *recorder) all() []*extprocv3.ProcessingResponse {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.replies)
}

// await returns the replies once there are n, failing the test if they do not come.
func (r *recorder) await(t *testing.T, n int) []*extprocv3.ProcessingResponse {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		r.mu.Lock()
		got, changed := slices.Clone(r.replies), r.changed
		r.mu.Unlock()
		if len(got) >= n {
			return got
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("%d replies, want %d: %v", len(got), n, got)
		}
	}
}

// drive passes msgs to a new exchange of s as Process would over a stream
// that Envoy half-closes after them, stopping where Process would return, and
// returns the replies.
func drive(t *testing.T, s *handlers.Server, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	rec := newRecorder()
	x := s.Open(t.Context(), rec)
	for _, m := range msgs {
		done, err := x.Handle(m)
		if err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
	}
	x.Close()
	return rec.all()
}

// --- over gRPC ---

// exchange sends msgs, half-closes like Envoy's graceful close, and returns every reply.
func exchange(t *testing.T, c extprocv3.ExternalProcessorClient, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	out, err := tryExchange(c, true, msgs...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryExchange is exchange for any goroutine: it returns the error. Without
// halfClose the server must end the stream itself.
func tryExchange(c extprocv3.ExternalProcessorClient, halfClose bool, msgs ...*extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, error) {
	out, err := envoymsg.Exchange(c, halfClose, msgs...)
	if err != nil {
		return nil, err
	}
	return out, nil
}

// --- reading replies ---

func headerValue(m *extprocv3.HeaderMutation, key string) (string, bool) {
	for _, h := range m.GetSetHeaders() {
		if h.GetHeader().GetKey() == key {
			if h.GetHeader().GetValue() != "" {
				panic("value must stay empty: Envoy rejects value together with raw_value")
			}
			return string(h.GetHeader().GetRawValue()), true
		}
	}
	return "", false
}

func metadataDestination(r *extprocv3.ProcessingResponse) string {
	return r.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()["x-gateway-destination-endpoint"].GetStringValue()
}

// checkRouting checks that r sends the request to endpoint with requestID, as
// the headers reply (FULL_DUPLEX, bodiless) or the body reply (BUFFERED) does.
func checkRouting(t *testing.T, r *extprocv3.ProcessingResponse, endpoint, requestID string) {
	t.Helper()
	common := r.GetRequestHeaders().GetResponse()
	if common == nil {
		common = r.GetRequestBody().GetResponse()
	}
	if got, _ := headerValue(common.GetHeaderMutation(), "x-gateway-destination-endpoint"); got != endpoint {
		t.Errorf("destination header = %q, want %q in %v", got, endpoint, r)
	}
	if got := metadataDestination(r); got != endpoint {
		t.Errorf("envoy.lb metadata = %q, want %q", got, endpoint)
	}
	if got, _ := headerValue(common.GetHeaderMutation(), "x-request-id"); got != requestID && (requestID != "" || len(got) != 36) {
		t.Errorf("x-request-id = %q, want %q (a UUID when empty)", got, requestID)
	}
	if !common.GetClearRouteCache() {
		t.Error("clear_route_cache not set")
	}
}

// streamedBody concatenates FULL_DUPLEX body replies and checks their size,
// and that only the last ends the stream (none, when trailers end it).
func streamedBody(t *testing.T, replies []*extprocv3.ProcessingResponse, trailers bool) string {
	t.Helper()
	for i, r := range replies {
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			t.Fatalf("reply %d is not a streamed_response body reply: %v", i, r)
		}
		if len(sr.GetBody()) > 62000 {
			t.Errorf("chunk %d has %d bytes, over 62000", i, len(sr.GetBody()))
		}
		if sr.GetEndOfStream() != (!trailers && i == len(replies)-1) {
			t.Errorf("chunk %d end_of_stream=%v", i, sr.GetEndOfStream())
		}
	}
	return joinStreamed(replies)
}

// joinStreamed joins the bodies of streamed_response replies.
func joinStreamed(replies []*extprocv3.ProcessingResponse) string {
	var b strings.Builder
	for _, r := range replies {
		b.Write(r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody())
	}
	return b.String()
}

func immediateOf(t *testing.T, replies []*extprocv3.ProcessingResponse) (int, map[string]any) {
	t.Helper()
	if len(replies) == 0 {
		t.Fatal("no reply")
	}
	ir := replies[len(replies)-1].GetImmediateResponse()
	if ir == nil {
		t.Fatalf("last reply is not an ImmediateResponse: %v", replies[len(replies)-1])
	}
	var body map[string]any
	if err := json.Unmarshal(ir.GetBody(), &body); err != nil {
		t.Fatalf("ImmediateResponse body is not JSON: %q", ir.GetBody())
	}
	return int(ir.GetStatus().GetCode()), body
}

// checkOpenAIError checks that the last reply is a local reply of status in
// OpenAI's error shape, its message containing message.
func checkOpenAIError(t *testing.T, replies []*extprocv3.ProcessingResponse, status int, message string) {
	t.Helper()
	got, body := immediateOf(t, replies)
	if got != status {
		t.Errorf("status = %d, want %d (body %v)", got, status, body)
	}
	e, _ := body["error"].(map[string]any)
	if msg, _ := e["message"].(string); !strings.Contains(msg, message) || e["type"] == nil || e["code"] != float64(got) {
		t.Errorf("error body = %v, want message containing %q, a type and code %d", body, message, got)
	}
	if ct, _ := headerValue(replies[len(replies)-1].GetImmediateResponse().GetHeaders(), "content-type"); ct != "application/json" {
		t.Errorf("content-type = %q, want application/json", ct)
	}
}
