package envoyemu

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// repoRoot is the module root: go test runs a package in its own directory.
func repoRoot(t testing.TB) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// loadShipped loads a shipped bootstrap for the scripted ext_proc servers of
// these tests, which speak plaintext gRPC: the ext_proc cluster's TLS
// (mTLS in every shipped file) is dropped. tls_test.go covers it.
func loadShipped(t testing.TB, name string) *Config {
	t.Helper()
	cfg := loadShippedAsIs(t, name)
	cfg.Clusters[cfg.ExtProcCluster].TLS = nil
	return cfg
}

func loadShippedAsIs(t testing.TB, name string) *Config {
	t.Helper()
	cfg, err := LoadConfig(filepath.Join(repoRoot(t), "config", "envoy", name))
	if err != nil {
		t.Fatalf("LoadConfig(%s): %v", name, err)
	}
	return cfg
}

// envoyError is the body the shipped configs' local_reply_config gives one
// of Envoy's own replies (§15): OpenAI's error JSON, keys sorted, one line.
func envoyError(code int, message, typ string) string {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"code": code, "message": message, "type": typ}})
	return string(b) + "\n"
}

// anthropicError is the body the shipped local_reply_config makes of one of
// Envoy's replies to the Messages API: Anthropic's error JSON.
func anthropicError(message, typ string) string {
	b, _ := json.Marshal(map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": message}})
	return string(b) + "\n"
}

// ---- scripted ext_proc server ----

// procStream is one Process stream as the scripted server sees it.
type procStream struct {
	t testing.TB
	extprocv3.ExternalProcessor_ProcessServer
}

// next returns the next message, or nil once the stream is over.
func (s *procStream) next() *extprocv3.ProcessingRequest {
	m, err := s.Recv()
	if err != nil {
		return nil
	}
	return m
}

func (s *procStream) reply(r *extprocv3.ProcessingResponse) {
	_ = s.Send(r)
}

type scriptedServer struct {
	extprocv3.UnimplementedExternalProcessorServer
	t      testing.TB
	handle func(s *procStream) error
}

func (f *scriptedServer) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	return f.handle(&procStream{t: f.t, ExternalProcessor_ProcessServer: stream})
}

// startExtProc serves handle for every Process stream on 127.0.0.1 and
// stops (waiting for the handlers) at cleanup.
func startExtProc(t testing.TB, handle func(s *procStream) error) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.WaitForHandlers(true))
	extprocv3.RegisterExternalProcessorServer(srv, &scriptedServer{t: t, handle: handle})
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return ln.Addr().String()
}

// startProxy runs the emulator against a scripted server and closes it at
// cleanup (before the server stops: cleanups run last-in first-out).
func startProxy(t testing.TB, cfg *Config, handle func(s *procStream) error) *Proxy {
	t.Helper()
	return startProxyOn(t, cfg, startExtProc(t, handle))
}

// startProxyOn runs the emulator against the ext_proc servers at addrs and
// closes it at cleanup.
func startProxyOn(t testing.TB, cfg *Config, addrs ...string) *Proxy {
	t.Helper()
	cfg.Logf = t.Logf
	p, err := Start(cfg, addrs...)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// startReplicas runs n ext_proc servers that route every request to the
// upstream at up, each first telling seen its index and the stream.
func startReplicas(t testing.TB, n int, up string, seen func(i int, s *procStream)) []string {
	t.Helper()
	var addrs []string
	for i := range n {
		addrs = append(addrs, startExtProc(t, func(s *procStream) error {
			seen(i, s)
			return fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up)), nil, nil)(s)
		}))
	}
	return addrs
}

// ---- reply builders ----

func rawHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}}
}

func lbMetadata(ns, addr string) *structpb.Struct {
	s, _ := structpb.NewStruct(map[string]any{ns: map[string]any{"x-gateway-destination-endpoint": addr}})
	return s
}

func requestHeadersReply(cr *extprocv3.CommonResponse, md *structpb.Struct) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: cr}},
		DynamicMetadata: md,
	}
}

func continueHeaders() *extprocv3.ProcessingResponse {
	return requestHeadersReply(&extprocv3.CommonResponse{}, nil)
}

// responseHeadersReply continues the response headers unchanged.
func responseHeadersReply() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
}

func requestBodyReply(cr *extprocv3.CommonResponse) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: cr}}}
}

// requestTrailersReply and responseTrailersReply answer trailers, setting hs.
func requestTrailersReply(hs ...*corev3.HeaderValueOption) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: trailersResponse(hs)}}
}

func responseTrailersReply(hs ...*corev3.HeaderValueOption) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: trailersResponse(hs)}}
}

func trailersResponse(hs []*corev3.HeaderValueOption) *extprocv3.TrailersResponse {
	tr := &extprocv3.TrailersResponse{}
	if len(hs) > 0 {
		tr.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: hs}
	}
	return tr
}

func streamedMutation(b []byte, eos bool) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
		Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: eos}},
	}}
}

func bodyMutation(b []byte, setHeaders ...*corev3.HeaderValueOption) *extprocv3.CommonResponse {
	cr := &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: b}}}
	if len(setHeaders) > 0 {
		cr.HeaderMutation = &extprocv3.HeaderMutation{SetHeaders: setHeaders}
	}
	return cr
}

func setHeaders(hs ...*corev3.HeaderValueOption) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: hs}}
}

func appendHeader(k, v string) *corev3.HeaderValueOption {
	h := rawHeader(k, v)
	h.Append = wrapperspb.Bool(true)
	return h
}

// ---- server scripts ----

// readRequestBody collects FULL_DUPLEX request chunks until end_of_stream
// (or the trailers message, which it returns).
func readRequestBody(s *procStream) (body []byte, trailers *extprocv3.HttpTrailers, ok bool) {
	for {
		m := s.next()
		if m == nil {
			return body, nil, false
		}
		switch r := m.Request.(type) {
		case *extprocv3.ProcessingRequest_RequestBody:
			body = append(body, r.RequestBody.GetBody()...)
			if r.RequestBody.GetEndOfStream() {
				return body, nil, true
			}
		case *extprocv3.ProcessingRequest_RequestTrailers:
			return body, r.RequestTrailers, true
		default:
			s.t.Errorf("unexpected message while reading the request body: %T", m.Request)
			return body, nil, false
		}
	}
}

// passResponse answers every response-path message unchanged (FULL_DUPLEX
// echo for bodies), until the stream ends.
func passResponse(s *procStream) {
	for {
		m := s.next()
		if m == nil {
			return
		}
		switch r := m.Request.(type) {
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			s.reply(responseHeadersReply())
		case *extprocv3.ProcessingRequest_ResponseBody:
			s.reply(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
				Response: streamedMutation(r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream()),
			}}})
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			s.reply(responseTrailersReply())
		default:
			s.t.Errorf("unexpected message on the response path: %T", m.Request)
			return
		}
	}
}

// fullDuplexRouter is the GIE-style FULL_DUPLEX script: buffer the whole
// body, answer headers (routing) then the new body as streamed_response,
// then pass the response through.
func fullDuplexRouter(headers *extprocv3.CommonResponse, md *structpb.Struct, newBody func([]byte) []byte) func(*procStream) error {
	return func(s *procStream) error {
		if m := s.next(); m.GetRequestHeaders() == nil {
			s.t.Errorf("first message = %T, want request_headers", m.GetRequest())
			return nil
		}
		body, _, ok := readRequestBody(s)
		if !ok {
			return nil
		}
		s.reply(requestHeadersReply(headers, md))
		if newBody != nil {
			body = newBody(body)
		}
		s.reply(requestBodyReply(streamedMutation(body, true)))
		passResponse(s)
		return nil
	}
}

// ---- upstream ----

type seenRequest struct {
	Method, Path, Host string
	Header             http.Header
	Body               []byte
	ContentLength      int64
	TransferEncoding   []string
	Trailer            http.Header
}

type upstream struct {
	*httptest.Server
	addr string
	mu   sync.Mutex
	seen []seenRequest
}

// startOnBody starts an upstream, and the shipped envoy.yaml in front of it
// with an ext_proc server that reads the request headers and the whole body
// and hands the body to script, with the upstream's address; a stream whose
// body does not come whole ends quietly.
func startOnBody(t testing.TB, script func(s *procStream, upstream string, body []byte) error) (*Proxy, *upstream) {
	t.Helper()
	up := startUpstream(t)
	return startProxy(t, loadShipped(t, "envoy.yaml"), func(s *procStream) error {
		s.next()
		body, _, ok := readRequestBody(s)
		if !ok {
			return nil
		}
		return script(s, up.addr, body)
	}), up
}

// startUpstream is an engine stand-in that records each request and answers
// "upstream:" + body.
func startUpstream(t testing.TB) *upstream {
	t.Helper()
	return startUpstreamWith(t, nil)
}

// startUpstreamWith records each request, then runs handle (nil = answer
// "upstream:" + body).
func startUpstreamWith(t testing.TB, handle http.HandlerFunc) *upstream {
	t.Helper()
	u := &upstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.seen = append(u.seen, seenRequest{
			Method: r.Method, Path: r.URL.RequestURI(), Host: r.Host, Header: r.Header.Clone(), Body: body,
			ContentLength: r.ContentLength, TransferEncoding: r.TransferEncoding, Trailer: r.Trailer.Clone(),
		})
		u.mu.Unlock()
		if handle != nil {
			handle(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write(append([]byte("upstream:"), body...))
	}))
	u.addr = strings.TrimPrefix(u.URL, "http://")
	t.Cleanup(u.Close)
	return u
}

func (u *upstream) requests() []seenRequest {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]seenRequest(nil), u.seen...)
}

// ---- client ----

type result struct {
	status  int
	header  http.Header
	trailer http.Header
	body    string
	err     error // from send only; doReq fails the test instead
}

func do(t testing.TB, p *Proxy, method, path, body string, hdr map[string]string) result {
	t.Helper()
	return doFrom(t, p, "", method, path, body, hdr)
}

// doFrom is do from the client address ip (a loopback one, 127.0.0.1 when
// empty), as a client at another address would send it.
func doFrom(t testing.TB, p *Proxy, ip, method, path, body string, hdr map[string]string) result {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(context.Background(), method, p.URL()+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	if ip == "" {
		return doReq(t, req)
	}
	res := sendFrom(req, ip)
	if res.err != nil {
		t.Fatal(res.err)
	}
	return res
}

func doReq(t testing.TB, req *http.Request) result {
	t.Helper()
	res := send(req)
	if res.err != nil {
		t.Fatal(res.err)
	}
	return res
}

// send makes one request on a fresh connection; a failure is in result.err,
// so it may run on any goroutine.
func send(req *http.Request) result { return sendFrom(req, "") }

// sendFrom is send from the local address ip, any when empty.
func sendFrom(req *http.Request, ip string) result {
	tr := &http.Transport{DisableKeepAlives: true}
	if ip != "" {
		tr.DialContext = (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}).DialContext
	}
	client := &http.Client{Transport: tr}
	resp, err := client.Do(req)
	if err != nil {
		return result{err: fmt.Errorf("%s %s: %w", req.Method, req.URL, err)}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{err: fmt.Errorf("reading response: %w", err)}
	}
	return result{status: resp.StatusCode, header: resp.Header, trailer: resp.Trailer, body: string(b)}
}

// streamedPost starts a POST to url whose body the caller writes through the
// returned pipe (and closes); the response, or the error, comes on the channel.
func streamedPost(url string) (*io.PipeWriter, <-chan result) {
	pr, pw := io.Pipe()
	req, _ := http.NewRequest(http.MethodPost, url, pr)
	resc := make(chan result, 1)
	go func() { resc <- send(req) }()
	return pw, resc
}

// chunkedBody hides the length so the client sends Transfer-Encoding: chunked.
type chunkedBody struct{ r io.Reader }

func (c chunkedBody) Read(p []byte) (int, error) { return c.r.Read(p) }

func chunked(s string) io.Reader { return chunkedBody{bytes.NewReader([]byte(s))} }
