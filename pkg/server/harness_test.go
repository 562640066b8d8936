package server

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

func TestMain(m *testing.M) {
	decodeEngine = startDecodeFake()
	decodeEP = decodeEngine.Listener.Addr().String()
	code := m.Run()
	decodeEngine.Close()
	if code == 0 { // as goleak.VerifyTestMain, with the fake closed first
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

const (
	chatPath = "/v1/chat/completions"
	// refusedEP is an engine address no test serves: nothing listens on
	// loopback's port 1, so each connection is refused at once, on the host.
	refusedEP = "127.0.0.1:1"
)

// decodeEP is the decode endpoint of the configs here, decodeEngine's
// address on loopback: the pools ask it for its models, and nothing else
// leaves the host. pd-extproc never sends it a request: Envoy sends the
// decode leg (start checks).
var (
	decodeEP     string
	decodeEngine *decodeFake
)

// decodeFake answers the pools' GETs 404 (a list --api-key guards: blind)
// and counts them; any other request is a decode leg pd-extproc sent.
type decodeFake struct {
	*httptest.Server
	gets, legs atomic.Int64
	got        chan struct{} // a GET came; never blocks
}

func startDecodeFake() *decodeFake {
	f := &decodeFake{got: make(chan struct{}, 1)}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			f.legs.Add(1)
			http.Error(w, "pd-extproc sent the decode leg", http.StatusInternalServerError)
			return
		}
		f.gets.Add(1)
		select {
		case f.got <- struct{}{}:
		default:
		}
		http.NotFound(w, r)
	}))
	return f
}

// The pools ask every endpoint for its models as the server starts, the
// decode endpoint of the tests too: it is a fake on loopback, so that no
// test reaches a host of the network (10.1.1.1:8000 was asked; on a network
// that drops packets each read waited out the check timeout).
func TestDecodeEPIsALocalFake(t *testing.T) {
	if ap, err := netip.ParseAddrPort(decodeEP); err != nil || !ap.Addr().IsLoopback() {
		t.Fatalf("decodeEP = %q, want a loopback address", decodeEP)
	}
	gets := decodeEngine.gets.Load()
	start(t, fmt.Sprintf("connector: kv-nixl\npools: {decode: {endpoints: [%q]}}", decodeEP), Options{}, logr.Discard())
	for decodeEngine.gets.Load() == gets {
		enginetest.Receive(t, decodeEngine.got, "the pools never asked the decode endpoint for its models")
	}
}

// running is a Server serving on loopback, as cmd/extproc runs it.
type running struct {
	*Server
	ext      extprocv3.ExternalProcessorClient
	health   healthpb.HealthClient
	admin    string // http://host:port
	grpcAddr string // host:port
	stop     context.CancelFunc
	signals  chan os.Signal // the process's signals, as Options.Signals
	served   chan error     // Serve's result
}

// start serves configYAML on loopback ports until the test ends.
func start(t *testing.T, configYAML string, opts Options, log logr.Logger) *running {
	t.Helper()
	signals := make(chan os.Signal, 1)
	opts.Signals = signals
	cfg, err := config.Parse([]byte(configYAML))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(cfg, opts, log)
	if err != nil {
		t.Fatal(err)
	}
	grpcLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	adminLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	r := &running{Server: s, admin: "http://" + adminLis.Addr().String(), grpcAddr: grpcLis.Addr().String(), stop: stop,
		signals: signals, served: make(chan error, 1)}
	legs := decodeEngine.legs.Load()
	go func() { r.served <- s.Serve(ctx, grpcLis, adminLis) }()
	conn, err := grpc.NewClient(grpcLis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	r.ext, r.health = extprocv3.NewExternalProcessorClient(conn), healthpb.NewHealthClient(conn)
	t.Cleanup(func() {
		conn.Close()
		stop()
		if err := r.wait(t); err != nil {
			t.Errorf("Serve: %v", err)
		}
		if n := decodeEngine.legs.Load() - legs; n != 0 {
			t.Errorf("pd-extproc sent %d requests to the decode endpoint; Envoy sends the decode leg", n)
		}
	})
	return r
}

// wait returns Serve's result, bounded so a hung shutdown fails the test.
func (r *running) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-r.served:
		r.served <- err // later callers (the cleanup) see it too
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return")
		return nil
	}
}

// adminClient keeps no idle connections, so nothing outlives a test.
var adminClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}

func (r *running) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := adminClient.Get(r.admin + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// scrape reads /metrics with the Prometheus text parser. Each series is keyed
// name{label="value",...} with labels sorted; a histogram gives name_count{...}
// and name_sum{...}.
func (r *running) scrape(t *testing.T) map[string]float64 {
	t.Helper()
	resp, err := adminClient.Get(r.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Fatalf("/metrics Content-Type = %q, want the text format", ct)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	out := map[string]float64{}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			labels := labelString(m.GetLabel())
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				out[name+labels] = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[name+labels] = m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[name+"_count"+labels] = float64(m.GetHistogram().GetSampleCount())
				out[name+"_sum"+labels] = m.GetHistogram().GetSampleSum()
			case dto.MetricType_SUMMARY:
				out[name+"_count"+labels] = float64(m.GetSummary().GetSampleCount())
			default:
				out[name+labels] = m.GetUntyped().GetValue()
			}
		}
	}
	return out
}

func labelString(pairs []*dto.LabelPair) string {
	if len(pairs) == 0 {
		return ""
	}
	s := make([]string, 0, len(pairs))
	for _, p := range pairs {
		s = append(s, fmt.Sprintf("%s=%q", p.GetName(), p.GetValue()))
	}
	slices.Sort(s)
	return "{" + strings.Join(s, ",") + "}"
}

// --- fake engines ---

const nixlParams = `{"do_remote_prefill":true,"remote_engine_id":"e-1","remote_block_ids":[1],"remote_host":"10.0.0.9","remote_port":5600}`

var prefillOK = enginetest.JSON(200, `{"choices":[{"text":"a"}],"kv_transfer_params":`+nixlParams+`}`)

// blocked answers with next once release is closed, or gives up with the request.
func blocked(release <-chan struct{}, next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
			next(w, r)
		case <-r.Context().Done():
		}
	}
}

// --- Envoy-shaped messages ---

type hdr = [2]string

func postHeaders(path, body string, extra ...hdr) *extprocv3.ProcessingRequest {
	headers := append([]hdr{{":method", "POST"}, {":path", path}, {":authority", "gw"},
		{"content-type", "application/json"}, {"content-length", fmt.Sprint(len(body))}}, extra...)
	return headersMsg(false, headers...)
}

func headersMsg(eos bool, headers ...hdr) *extprocv3.ProcessingRequest {
	hm := &corev3.HeaderMap{}
	for _, h := range headers {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: h[0], RawValue: []byte(h[1])})
	}
	return &extprocv3.ProcessingRequest{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hm, EndOfStream: eos}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}
}

func bodyMsg(body string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(body), EndOfStream: true}}}
}

// post is a whole FULL_DUPLEX request: headers then the body in one chunk.
func post(path, body string, extra ...hdr) []*extprocv3.ProcessingRequest {
	return []*extprocv3.ProcessingRequest{postHeaders(path, body, extra...), bodyMsg(body)}
}

// exchange sends msgs, half-closes like Envoy, and returns every reply.
func (r *running) exchange(t *testing.T, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	out, err := r.tryExchange(msgs...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryExchange is exchange for goroutines other than the test's.
func (r *running) tryExchange(msgs ...*extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, error) {
	return envoymsg.Exchange(r.ext, true, msgs...)
}

func destination(resp *extprocv3.ProcessingResponse) string {
	for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
			return string(h.GetHeader().GetRawValue())
		}
	}
	return ""
}
