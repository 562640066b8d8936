package handlers_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/server/assemble"
)

// fuzzRecorder wraps the server side of the stream and logs, in the order the
// handler did them, every message it read and every reply it sent: each reply
// belongs to the last message read before it.
type fuzzRecorder struct {
	mu      sync.Mutex
	events  []fuzzEvent
	recvErr error // how the handler's last Recv failed
	ret     error // what Process returned
	done    chan struct{}
}

type fuzzEvent struct {
	recv *extprocv3.ProcessingRequest
	sent *extprocv3.ProcessingResponse
}

type fuzzServerStream struct {
	grpc.ServerStream
	rec *fuzzRecorder
}

func (s fuzzServerStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	if err != nil {
		s.rec.recvErr = err
		return err
	}
	s.rec.events = append(s.rec.events, fuzzEvent{recv: proto.Clone(m.(proto.Message)).(*extprocv3.ProcessingRequest)})
	return nil
}

func (s fuzzServerStream) SendMsg(m any) error {
	s.rec.mu.Lock()
	s.rec.events = append(s.rec.events, fuzzEvent{sent: proto.Clone(m.(proto.Message)).(*extprocv3.ProcessingResponse)})
	s.rec.mu.Unlock()
	return s.ServerStream.SendMsg(m)
}

func (r *fuzzRecorder) intercept(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if info.FullMethod != "/envoy.service.ext_proc.v3.ExternalProcessor/Process" {
		return handler(srv, ss)
	}
	defer close(r.done)
	err := handler(srv, fuzzServerStream{ss, r})
	r.mu.Lock()
	r.ret = err
	r.mu.Unlock()
	return err
}

// fuzzEngine is the fake prefill engine.
type fuzzEngine struct {
	*httptest.Server
	behaviour int
}

func newFuzzEngine(behaviour int) *fuzzEngine {
	e := &fuzzEngine{behaviour: behaviour}
	e.Server = httptest.NewServer(http.HandlerFunc(e.serve))
	return e
}

func (e *fuzzEngine) serve(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	params := func() {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"p","choices":[{"text":"a"}],"kv_transfer_params":`+fuzzPrefillParams+`}`)
	}
	switch e.behaviour {
	case prefillParams:
		params()
	case prefillNullParams:
		io.WriteString(w, `{"id":"p","kv_transfer_params":null}`)
	case prefillNoParams:
		io.WriteString(w, `{"id":"p"}`)
	case prefillArrayParams:
		io.WriteString(w, `{"id":"p","kv_transfer_params":[1,2]}`)
	case prefill5xx:
		http.Error(w, `{"error":"overloaded"}`, http.StatusServiceUnavailable)
	case prefill4xx:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"object":"error","message":"bad","code":400}`)
	case prefill4xxNoType:
		w.Header()["Content-Type"] = nil
		w.WriteHeader(http.StatusUnprocessableEntity)
		io.WriteString(w, "unprocessable")
	case prefillSlow:
		t := time.NewTimer(3 * time.Millisecond)
		defer t.Stop()
		select {
		case <-t.C:
			params()
		case <-r.Context().Done():
		}
	case prefillHang:
		<-r.Context().Done()
	case prefillDrop:
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	case prefillGarbage:
		io.WriteString(w, "<html>not json")
	}
}

func (e *fuzzEngine) addr() string { return strings.TrimPrefix(e.URL, "http://") }

func runFuzzCase(t *testing.T, c *fuzzCase) {
	leaks := goleak.IgnoreCurrent()
	eng := newFuzzEngine(c.prefill)
	prefillAddrs := []string{eng.addr()}
	if c.prefill == prefillRefused {
		prefillAddrs[0] = "127.0.0.1:1"
	}
	var second *fuzzEngine
	if c.twoPrefills {
		second = newFuzzEngine(prefillParams)
		prefillAddrs = append(prefillAddrs, second.addr())
	}
	yaml := fmt.Sprintf("connector: %s\npools: {prefill: {endpoints: [%s], bootstrap_port: %d}, decode: {endpoints: [%s]}}\nprefill: {timeout: 50ms, on_failure: %s}\n",
		c.connector, fuzzQuote(prefillAddrs), fuzzBootstrapPort, fuzzQuote(fuzzDecodeEndpoints), map[bool]string{false: "decode-only", true: "fail"}[c.onFailureFail])
	if c.smallLimit {
		yaml += "limits: {max_body_bytes: 300}\n"
	}
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatalf("config: %v\n%s", err, yaml)
	}
	log := logr.Discard()
	if c.verbose {
		log = funcr.New(func(string, string) {}, funcr.Options{Verbosity: 2})
	}
	var m *metrics.Metrics
	var popts []pipeline.Option
	if c.metrics {
		m = metrics.New(c.connector)
		popts = append(popts, pipeline.WithMetrics(m))
	}
	p, err := assemble.Pipeline(cfg, log, popts...)
	if err != nil {
		t.Fatal(err)
	}
	rec := &fuzzRecorder{done: make(chan struct{})}
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer(grpc.StreamInterceptor(rec.intercept), grpc.WaitForHandlers(true), grpc.MaxRecvMsgSize(int(cfg.Limits.MaxBodyBytes)+1<<20))
	extprocv3.RegisterExternalProcessorServer(srv, handlers.NewServer(p, handlers.Options{
		OverrideAfter: c.overrideAfter, OverrideTimeout: 90 * time.Second, Metrics: m, LogPrompts: c.verbose,
	}, log))
	served := make(chan struct{})
	go func() { srv.Serve(lis); close(served) }()
	conn, err := grpc.NewClient("passthrough:///bufconn", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }))
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), fuzzStreamBound)
	replies := make(chan int, 1)
	stream, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	go func() { // Envoy reads every reply until the stream ends
		n := 0
		for {
			if _, err := stream.Recv(); err != nil {
				replies <- n
				return
			}
			n++
		}
	}()
	reset := false
	for i, msg := range c.msgs {
		if i == c.cancelAt {
			cancel()
			reset = true
			break
		}
		if stream.Send(msg) != nil {
			break // the server ended the stream (an ImmediateResponse)
		}
	}
	if !reset {
		// Envoy's graceful close: a half-close, seen as EOF. The handler must
		// end by itself.
		stream.CloseSend()
		select {
		case <-rec.done:
		case <-time.After(fuzzStreamBound):
			t.Fatalf("deadlock: Process has not returned %v after the half-close\n%s", fuzzStreamBound, fuzzTrace(c, rec))
		}
	}
	select {
	case <-replies:
	case <-time.After(fuzzStreamBound):
		t.Fatalf("the client stream did not end after %v\n%s", fuzzStreamBound, fuzzTrace(c, rec))
	}
	cancel()
	conn.Close()
	// After a reset the handler may or may not have started; Stop waits for
	// any that did (WaitForHandlers).
	stopped := make(chan struct{})
	go func() { srv.Stop(); <-served; close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(fuzzStreamBound):
		t.Fatalf("deadlock: a handler still runs %v after the stream was reset\n%s", fuzzStreamBound, fuzzTrace(c, rec))
	}
	waited := make(chan struct{})
	go func() { p.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(fuzzStreamBound):
		t.Fatalf("background prefill legs still running after %v", fuzzStreamBound)
	}
	eng.CloseClientConnections()
	eng.Close()
	if second != nil {
		second.CloseClientConnections()
		second.Close()
	}
	if err := goleak.Find(leaks); err != nil {
		t.Fatalf("goroutines outlived the stream: %v\n%s", err, fuzzTrace(c, rec))
	}

	rec.mu.Lock()
	defer rec.mu.Unlock()
	if problems := checkFuzzExchange(c, rec, reset); len(problems) > 0 {
		t.Fatalf("%s\n%s", strings.Join(problems, "\n"), fuzzTrace(c, rec))
	}
}

func fuzzQuote(addrs []string) string {
	q := make([]string, len(addrs))
	for i, a := range addrs {
		q[i] = strconv.Quote(a)
	}
	return strings.Join(q, ", ")
}

// fuzzTrace prints the case and what the handler read and sent, for a failure.
func fuzzTrace(c *fuzzCase, rec *fuzzRecorder) string {
	var b strings.Builder
	fmt.Fprintf(&b, "case: connector=%s prefill=%d fail=%v smallLimit=%v override=%v cancelAt=%d, %d messages\n",
		c.connector, c.prefill, c.onFailureFail, c.smallLimit, c.overrideAfter, c.cancelAt, len(c.msgs))
	for _, e := range rec.events {
		if e.recv != nil {
			fmt.Fprintf(&b, "  -> %.300s\n", e.recv.String())
		} else {
			fmt.Fprintf(&b, "  <- %.300s\n", e.sent.String())
		}
	}
	fmt.Fprintf(&b, "  recv error: %v; Process returned: %v\n", rec.recvErr, rec.ret)
	return b.String()
}
