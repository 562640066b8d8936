package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/pd-extproc/pd-extproc/bench/internal/echo"
)

// TestSmoke runs one small cell per mode against the echo server in-process,
// so the driver does not rot between benchmark runs.
func TestSmoke(t *testing.T) {
	client := startEcho(t)

	p := NewPayload(chatBody(150<<10, 1)) // three FULL_DUPLEX chunks, three reply chunks
	for _, mode := range []Mode{FullDuplex, Buffered} {
		t.Run(mode.String(), func(t *testing.T) {
			cell := Cell{Target: TargetEcho, Mode: mode, Size: 150 << 10, Concurrency: 3}
			if err := verify(context.Background(), client, cell, p, nil); err != nil {
				t.Fatal(err)
			}
			res := client.Run(context.Background(), Load{Mode: mode, Payload: p, Concurrency: 3, Requests: 10, IDPrefix: "smoke"})
			if res.Errors != 0 || len(res.Latencies) != 10 {
				t.Fatalf("%d completed, %d errors (first: %v), want 10 and 0", len(res.Latencies), res.Errors, res.FirstErr)
			}
			if Percentile(res.Latencies, 0.5) > Percentile(res.Latencies, 0.99) {
				t.Error("p50 > p99")
			}
		})
	}
}

// TestSmokeResponsePath plays answers through the echo server: each chunk
// comes back as it went, in its own reply, and is timed.
func TestSmokeResponsePath(t *testing.T) {
	client := startEcho(t)

	p, a := NewPayload(chatBody(4<<10, 1)), NewAnswer(5)
	cell := Cell{Target: TargetEcho, Mode: FullDuplex, Size: 4 << 10, Concurrency: 2, Tokens: 5}
	if err := verify(context.Background(), client, cell, p, a); err != nil {
		t.Fatal(err)
	}
	res := client.Run(context.Background(), Load{Mode: FullDuplex, Payload: p, Answer: a, Concurrency: 2, Requests: 4, IDPrefix: "smoke"})
	// Per answer: a role event, 5 token events, the usage event, [DONE].
	if res.Errors != 0 || len(res.Latencies) != 4 || len(res.Chunks) != 4*8 {
		t.Fatalf("%d completed with %d chunks, %d errors (first: %v); want 4 with 32 and 0", len(res.Latencies), len(res.Chunks), res.Errors, res.FirstErr)
	}
	if err := checkAnswer(a, []byte("data: [DONE]\n\n"), decodeCachedTokens); err == nil {
		t.Error("checkAnswer accepted a cut answer")
	}
}

// startEcho serves the echo server in-process until the test ends and
// returns a client of it.
func startEcho(t *testing.T) *Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, echo.Server{})
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	client, err := Dial(lis.Addr().String(), 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	return client
}

func TestChatBodyIsValidJSONOfTheRequestedSize(t *testing.T) {
	for _, size := range []int{4 << 10, 256 << 10, 2 << 20} {
		b := chatBody(size, uint64(size))
		var v struct {
			Model    string `json:"model"`
			Messages []struct{ Role, Content string }
		}
		if err := json.Unmarshal(b, &v); err != nil {
			t.Fatalf("%s: %v", sizeName(size), err)
		}
		if v.Model != Model || len(v.Messages) < 2 {
			t.Errorf("%s: model %q, %d messages", sizeName(size), v.Model, len(v.Messages))
		}
		if d := len(b) - size; d < -64 || d > 0 {
			t.Errorf("%s: %d bytes, want within 64 below", sizeName(size), len(b))
		}
		if !bytes.Contains(b, []byte(`\n`)) || !strings.Contains(string(b), "東京") {
			t.Errorf("%s: no escapes or non-ASCII text", sizeName(size))
		}
	}
}

// TestPayloadIsCutAsEnvoyForwardsIt: the messages a payload carries are
// built once, as Envoy sends them: 64 KiB data chunks in FULL_DUPLEX, the last
// with end_of_stream, and the whole body in BUFFERED.
func TestPayloadIsCutAsEnvoyForwardsIt(t *testing.T) {
	body := chatBody(150<<10, 1)
	p := NewPayload(body)
	var joined []byte
	for i, m := range p.fullDuplex {
		b := m.GetRequestBody()
		if last := i == len(p.fullDuplex)-1; b.GetEndOfStream() != last || (!last && len(b.GetBody()) != envoyChunk) {
			t.Errorf("chunk %d: %d bytes, end_of_stream %v", i, len(b.GetBody()), b.GetEndOfStream())
		}
		joined = append(joined, b.GetBody()...)
	}
	if len(p.fullDuplex) != 3 || !bytes.Equal(joined, body) {
		t.Errorf("%d chunks holding %d bytes, want 3 holding the %d of the body", len(p.fullDuplex), len(joined), len(body))
	}
	if b := p.buffered.GetRequestBody(); !bytes.Equal(b.GetBody(), body) || !b.GetEndOfStream() {
		t.Errorf("BUFFERED: %d bytes, end_of_stream %v; want the whole body, ended", len(b.GetBody()), b.GetEndOfStream())
	}
	h := headersMessage(Buffered, len(body), "id-1", false)
	if h.GetProtocolConfig().GetRequestBodyMode() != Buffered.proto() || len(h.GetRequestHeaders().GetHeaders().GetHeaders()) != 14 {
		t.Errorf("headers message %v: want protocol_config and the 14 headers Envoy sends", h)
	}
}

// The loopback baseline posts the prefill leg extproc would send for each
// benchmark body: the client's body with vLLM's prefill fields in, and
// what the client may not set out.
func TestPrefillLegIsWhatExtprocSends(t *testing.T) {
	leg, err := prefillLeg([]byte(`{"model":"m","messages":[{"role":"user","content":"Hello!"}],"stream":true,"kv_transfer_params":{"x":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(leg, &got); err != nil {
		t.Fatalf("%s: %v", leg, err)
	}
	kv, _ := got["kv_transfer_params"].(map[string]any)
	if kv["do_remote_decode"] != true || kv["x"] != nil || got["stream"] != false || got["max_tokens"] != 1.0 {
		t.Errorf("prefill leg %s: want the client's kv_transfer_params replaced by vLLM's, stream false and max_tokens 1", leg)
	}
}
