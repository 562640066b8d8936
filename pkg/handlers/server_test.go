package handlers_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// nixlParams is what a current vLLM prefill returns: nested lists, keys we do not
// know, and an integer too large for a float64 — all must reach decode unchanged.
const nixlParams = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2],[3]],` +
	`"remote_engine_id":"e-1","remote_request_id":"chatcmpl-r1-0a1b2c3d","remote_host":"10.0.0.9","remote_port":5600,` +
	`"tp_size":1,"future_key":{"n":12345678901234567890}}`

var prefillOK = enginetest.JSON(200, `{"id":"x","choices":[{"text":"a"}],"kv_transfer_params":`+nixlParams+`}`)

// startServer serves the ext_proc service on loopback and returns a client.
func startServer(t *testing.T, cfg *config.Config, opts handlers.Options) extprocv3.ExternalProcessorClient {
	t.Helper()
	p, err := pipeline.New(cfg, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, handlers.NewServer(p, opts, logr.Discard()))
	go srv.Serve(lis)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		p.Wait()
	})
	return extprocv3.NewExternalProcessorClient(conn)
}

func testConfig(t *testing.T, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// --- Envoy-shaped messages ---

type hdr = [2]string

func requestHeaders(mode filterv3.ProcessingMode_BodySendMode, eos bool, headers ...hdr) *extprocv3.ProcessingRequest {
	hm := &corev3.HeaderMap{}
	for _, h := range headers {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: h[0], RawValue: []byte(h[1])})
	}
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hm, EndOfStream: eos}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  mode,
			ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		},
	}
}

func postHeaders(mode filterv3.ProcessingMode_BodySendMode, path string, body string, extra ...hdr) *extprocv3.ProcessingRequest {
	h := append([]hdr{{":method", "POST"}, {":path", path}, {":authority", "gw"}, {":scheme", "http"},
		{"content-type", "application/json"}, {"content-length", fmt.Sprint(len(body))}}, extra...)
	return requestHeaders(mode, false, h...)
}

func requestBody(chunk string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: eos}}}
}

func requestTrailers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{
		RequestTrailers: &extprocv3.HttpTrailers{Trailers: &corev3.HeaderMap{}}}}
}

func responseBody(chunk string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: []byte(chunk), EndOfStream: eos}}}
}

// split cuts body into n chunks as Envoy forwards data frames in FULL_DUPLEX.
func split(body string, n int) []*extprocv3.ProcessingRequest {
	var msgs []*extprocv3.ProcessingRequest
	size := (len(body) + n - 1) / n
	for i := 0; i < len(body); i += size {
		end := min(i+size, len(body))
		msgs = append(msgs, requestBody(body[i:end], end == len(body)))
	}
	return msgs
}

// exchange sends msgs, half-closes like Envoy's graceful close, and returns every reply.
func exchange(t *testing.T, c extprocv3.ExternalProcessorClient, msgs ...*extprocv3.ProcessingRequest) []*extprocv3.ProcessingResponse {
	t.Helper()
	out, err := tryExchange(c, msgs...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// tryExchange is exchange for any goroutine: it returns the error.
func tryExchange(c extprocv3.ExternalProcessorClient, msgs ...*extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := c.Process(ctx)
	if err != nil {
		return nil, err
	}
	for _, m := range msgs {
		if err := s.Send(m); err != nil {
			return nil, err
		}
	}
	s.CloseSend()
	var out []*extprocv3.ProcessingResponse
	for {
		r, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("Recv: %w", err)
		}
		out = append(out, r)
	}
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

// streamedBody concatenates FULL_DUPLEX body replies and checks only the last ends the stream.
func streamedBody(t *testing.T, replies []*extprocv3.ProcessingResponse) string {
	t.Helper()
	for i, r := range replies {
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			t.Fatalf("reply %d is not a streamed_response body reply: %v", i, r)
		}
		if len(sr.GetBody()) > 62000 {
			t.Errorf("chunk %d has %d bytes, over 62000", i, len(sr.GetBody()))
		}
		if sr.GetEndOfStream() != (i == len(replies)-1) {
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
