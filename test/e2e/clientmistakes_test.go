package e2e

import (
	"bufio"
	"bytes"
	"cmp"
	"compress/flate"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// clientMistake is one request a careless or hostile client sends through
// the emulator's listener, and what the client must see: the engine's own
// answer passed through, or pd-extproc's OpenAI-style error; and which
// engines saw it (legs), so that no prefill leg runs for a request the
// decode engine must refuse.
type clientMistake struct {
	name, method, path, body string
	contentType              string // "" is application/json; "none" sends none
	encoding                 string // gzip, deflate or br: the body is sent so encoded
	want                     int
	by                       string // extproc (a local reply it asked for), engine or envoy
	errType, says            string // of an error answer
	prefills, decodes        int    // legs the engines saw
	stream                   bool   // a 200 is an event stream
}

const chatOf = `{"model":"pdsim","messages":[{"role":"user","content":"mistake"}],"max_tokens":4`

// TestAClientsMistakesThroughTheStack sends, as a client would, requests
// that vLLM's OpenAI server refuses or reads in its own way, and checks each
// answer and the legs it cost (docs/engines.md, API by API, item 12).
func TestAClientsMistakesThroughTheStack(t *testing.T) {
	json400 := func(name, body, says string) clientMistake {
		return clientMistake{name: name, body: body, want: 400, by: "engine", errType: "BadRequestError", says: says, decodes: 1}
	}
	refusedByPrefill := func(name, body, says string) clientMistake {
		return clientMistake{name: name, body: body, want: 400, by: "extproc", errType: "BadRequestError", says: says, prefills: 1}
	}
	tests := []clientMistake{
		// No engine decodes a request body (vLLM's FastAPI reads the bytes as JSON).
		{name: "gzip", body: chatOf + "}", encoding: "gzip", want: 400, by: "extproc", errType: "invalid_request_error", says: "not valid"},
		{name: "deflate", body: chatOf + "}", encoding: "deflate", want: 400, by: "extproc", errType: "invalid_request_error", says: "not valid"},
		{name: "br", body: chatOf + "}", encoding: "br", want: 400, by: "extproc", errType: "invalid_request_error", says: "not valid JSON"},
		{name: "a byte order mark", body: "\ufeff" + chatOf + "}", want: 200, prefills: 1, decodes: 1},
		{name: "stream null", body: chatOf + `,"stream":null}`, want: 200, prefills: 1, decodes: 1},
		{name: `stream "true"`, body: chatOf + `,"stream":"true"}`, want: 200, prefills: 1, decodes: 1, stream: true},
		json400("max_tokens 1e309", strings.Replace(chatOf, `"max_tokens":4`, `"max_tokens":1e309`, 1)+"}", "max_tokens"),
		json400("max_tokens -1", strings.Replace(chatOf, `"max_tokens":4`, `"max_tokens":-1`, 1)+"}", "max_tokens"),
		json400("max_tokens 1.5", strings.Replace(chatOf, `"max_tokens":4`, `"max_tokens":1.5`, 1)+"}", "max_tokens"),
		{name: "n 2", body: chatOf + `,"n":2}`, want: 200, decodes: 1},
		// Refused by the prefill engine as the decode engine would: its answer is passed on.
		refusedByPrefill("messages []", `{"model":"pdsim","messages":[],"max_tokens":4}`, "messages"),
		refusedByPrefill("messages not an array", `{"model":"pdsim","messages":"mistake","max_tokens":4}`, "messages"),
		{name: "model missing", body: `{"messages":[{"role":"user","content":"mistake"}],"max_tokens":4}`, want: 200, prefills: 1, decodes: 1},
		{name: "model empty", body: strings.Replace(chatOf, `"pdsim"`, `""`, 1) + "}", want: 200, prefills: 1, decodes: 1},
		refusedByPrefill("model not a string", strings.Replace(chatOf, `"pdsim"`, `7`, 1)+"}", "model"),
		// Each prefill engine asked answers 404 before computing anything, as
		// another may serve the name; then the decode engine answers its own
		// (unserved_model, docs/metrics.md).
		{name: "model unknown", body: strings.Replace(chatOf, `"pdsim"`, `"nope"`, 1) + "}", want: 404, by: "engine", errType: "NotFoundError",
			says: "The model `nope` does not exist.", prefills: 2, decodes: 1},
		json400("stream_options without stream", chatOf+`,"stream_options":{"include_usage":true}}`, "Stream options can only be defined when `stream=True`."),
		{name: "generate without Content-Type", path: "/inference/v1/generate", contentType: "none", body: `{"token_ids":[1,2],"sampling_params":{"max_tokens":4}}`,
			want: 400, by: "extproc", errType: "invalid_request_error", says: "the request has no Content-Type"},
		{name: "prompt of token ids", path: "/v1/completions", body: `{"model":"pdsim","prompt":[1,2,3],"max_tokens":4}`, want: 200, prefills: 1, decodes: 1},
		{name: "prompt of strings", path: "/v1/completions", body: `{"model":"pdsim","prompt":["a","b"],"max_tokens":4}`, want: 200, decodes: 1},
		{name: "no Content-Type", body: chatOf + "}", contentType: "none", want: 400, by: "extproc", errType: "invalid_request_error",
			says: "the request has no Content-Type; the engines take this API's body as application/json only"},
		{name: "Content-Type text/plain", body: chatOf + "}", contentType: "text/plain", want: 400, by: "extproc", errType: "invalid_request_error",
			says: `Content-Type is "text/plain"; the engines take this API's body as application/json only`},
		{name: "Content-Type application/json", body: chatOf + "}", want: 200, prefills: 1, decodes: 1},
		{name: "charset=latin1", body: chatOf + "}", contentType: "Application/JSON; charset=latin1", want: 200, prefills: 1, decodes: 1},
		// CORS is Envoy's cors filter's to answer, before ext_proc.
		{name: "OPTIONS preflight", method: http.MethodOptions, want: 404, by: "extproc", errType: "invalid_request_error", says: "is not routed"},
		{name: "HEAD", method: http.MethodHead, want: 404, by: "extproc"},
		{name: "a query string", path: "/v1/chat/completions?api-version=1", body: chatOf + "}", want: 200, prefills: 1, decodes: 1},
		{name: "a trailing slash", path: "/v1/chat/completions/", body: chatOf + "}", want: 404, by: "extproc", errType: "invalid_request_error", says: "unknown path"},
		{name: "a percent-encoded slash", path: "/v1/chat%2Fcompletions", body: chatOf + "}", want: 404, by: "extproc", errType: "invalid_request_error"},
	}
	for _, mode := range []string{"full_duplex", "buffered"} {
		t.Run(mode, func(t *testing.T) {
			// Long answers, cut by each request's max_tokens: a stream lasts
			// until its client leaves.
			r := startRig(t, rigOptions{mode: mode, outputTokens: 1_000_000})
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					before := legCounts(r)
					resp, got := tt.send(t, r)
					tt.check(t, resp, got)
					if p, d := legCounts(r).minus(before); p != tt.prefills || d != tt.decodes {
						t.Errorf("%d prefill and %d decode legs, want %d and %d", p, d, tt.prefills, tt.decodes)
					}
					r.healthy(t, "after "+tt.name)
				})
			}
			t.Run("a body that ends early", func(t *testing.T) { bodyEndsEarly(t, r) })
			t.Run("a client that leaves mid-stream", func(t *testing.T) { clientLeavesMidStream(t, r) })
		})
	}
}

func (tt clientMistake) send(t *testing.T, r *rig) (*http.Response, string) {
	t.Helper()
	body := []byte(tt.body)
	switch tt.encoding {
	case "gzip", "deflate":
		var buf bytes.Buffer
		w := io.WriteCloser(gzip.NewWriter(&buf))
		if tt.encoding == "deflate" {
			w, _ = flate.NewWriter(&buf, flate.BestSpeed)
		}
		w.Write(body)
		w.Close()
		body = buf.Bytes()
	case "br":
		body = brotliStored(body)
	}
	method, path := cmp.Or(tt.method, http.MethodPost), cmp.Or(tt.path, "/v1/chat/completions")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var rd io.Reader
	if len(body) > 0 {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, r.proxy.URL()+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	switch tt.contentType {
	case "":
		req.Header.Set("Content-Type", "application/json")
	case "none":
	default:
		req.Header.Set("Content-Type", tt.contentType)
	}
	if tt.encoding != "" {
		req.Header.Set("Content-Encoding", tt.encoding)
	}
	if method == http.MethodOptions { // a browser's CORS preflight
		req.Header.Set("Origin", "https://app.example")
		req.Header.Set("Access-Control-Request-Method", "POST")
	}
	resp, err := testbed.Client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the answer: %v", method, path, err)
	}
	return resp, string(got)
}

func (tt clientMistake) check(t *testing.T, resp *http.Response, got string) {
	t.Helper()
	details := resp.Header.Get(envoyemu.DetailsHeader)
	if resp.StatusCode != tt.want {
		t.Errorf("status %d (%s): %s; want %d", resp.StatusCode, details, excerpt(got), tt.want)
		return
	}
	if fromExtproc := details == fmt.Sprintf("pd_extproc_%d", tt.want); fromExtproc != (tt.by == "extproc") {
		t.Errorf("answered with details %q; want it from %s", details, cmp.Or(tt.by, "the engine"))
	}
	if tt.want == 200 {
		checkCompletion(t, tt.stream, got)
		return
	}
	if tt.errType == "" { // HEAD: no body to read
		return
	}
	var e struct {
		Error struct {
			Message string          `json:"message"`
			Type    string          `json:"type"`
			Param   json.RawMessage `json:"param"`
			Code    int             `json:"code"`
		} `json:"error"`
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	if err := json.Unmarshal([]byte(got), &e); err != nil || e.Error.Type != tt.errType || e.Error.Code != tt.want ||
		!strings.Contains(e.Error.Message, tt.says) {
		t.Errorf("error %s, want type %s, code %d, a message with %q", got, tt.errType, tt.want, tt.says)
	}
}

// legs counts the legs the rig's engines have seen: prefill, decode.
type legs struct{ prefill, decode int }

func legCounts(r *rig) legs {
	var l legs
	for _, s := range r.prefill {
		l.prefill += len(s.Requests())
	}
	for _, s := range r.decode {
		l.decode += len(s.Requests())
	}
	return l
}

func (l legs) minus(o legs) (int, int) { return l.prefill - o.prefill, l.decode - o.decode }

// brotliStored frames b as a brotli stream of one uncompressed meta-block
// (RFC 7932, section 9.2: WBITS 16, MNIBBLES 4, ISUNCOMPRESSED), then an empty last
// one: brotli's bytes for b without a brotli library.
func brotliStored(b []byte) []byte {
	v := uint32(len(b)-1)<<4 | 1<<20
	out := append([]byte{byte(v), byte(v >> 8), byte(v >> 16)}, b...)
	return append(out, 0x03)
}

// bodyEndsEarly: a client declares a Content-Length and closes after part
// of it. No engine sees the request, extproc closes the stream, and stays
// healthy.
func bodyEndsEarly(t *testing.T, r *rig) {
	before := legCounts(r)
	conn, err := net.Dial("tcp", strings.TrimPrefix(r.proxy.URL(), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	part := chatOf + `,"stream":true`
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(part)+100, part)
	conn.(*net.TCPConn).CloseWrite()
	conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err == nil {
		got, _ := io.ReadAll(resp.Body)
		t.Logf("the emulator answered the cut body %d %v: %s", resp.StatusCode, resp.Header, excerpt(string(got)))
		if resp.StatusCode < 400 || resp.StatusCode >= 500 {
			t.Errorf("status %d for a body that never came whole, want a 4xx or none", resp.StatusCode)
		}
	}
	conn.Close()
	waitFor(t, 10*time.Second, "extproc to close the stream", func() bool { return r.metric(t, "pd_extproc_streams_in_flight") == 0 })
	if p, d := legCounts(r).minus(before); p != 0 || d != 0 {
		t.Errorf("%d prefill and %d decode legs for a body that never came whole", p, d)
	}
	r.healthy(t, "after a cut body")
}

// clientLeavesMidStream: a client that leaves while tokens stream has its
// decode leg cancelled; extproc closes the stream and stays healthy.
func clientLeavesMidStream(t *testing.T, r *rig) {
	marker := "leaves mid-stream " + r.mode
	path, body := request("chat", true, marker)
	body = strings.Replace(body, `"max_tokens":4`, `"max_tokens":30000`, 1) // 30 s of tokens
	ctx, cancel := context.WithCancel(context.Background())
	resp := r.stream(t, ctx, path, body)
	cancel()
	resp.Body.Close()
	waitFor(t, 10*time.Second, "the decode engine to see the leg cancelled", func() bool {
		recs := recordsWith(r.decode, marker)
		return len(recs) == 1 && recs[0].Canceled
	})
	waitFor(t, 10*time.Second, "extproc to close the stream", func() bool { return r.metric(t, "pd_extproc_streams_in_flight") == 0 })
	r.healthy(t, marker+" after")
}
