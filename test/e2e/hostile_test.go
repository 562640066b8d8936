package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/pdsim"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// recorder is an HTTP endpoint that only counts and keeps what reaches it:
// somewhere nothing may go (an attacker's host), or, with next set, a
// transparent proxy in front of a simulator that keeps the headers it saw.
type recorder struct {
	*httptest.Server
	mu      sync.Mutex
	headers []http.Header
	paths   []string
}

func newRecorder(t *testing.T, next string) *recorder {
	rec := &recorder{}
	var proxy http.Handler
	if next != "" {
		target := "http://" + next
		proxy = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// The body is read whole first: once the answer's headers are
			// flushed, Go's HTTP/1 server may close the request body, and a
			// transport still reading it (for the end of the body) then
			// closes its connection under the answer it is streaming.
			in, err := io.ReadAll(r.Body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			out, err := http.NewRequestWithContext(r.Context(), r.Method, target+r.URL.RequestURI(), bytes.NewReader(in))
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			out.Header = r.Header.Clone()
			resp, err := http.DefaultTransport.RoundTrip(out)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			defer resp.Body.Close()
			for k, v := range resp.Header {
				w.Header()[k] = v
			}
			w.WriteHeader(resp.StatusCode)
			rc := http.NewResponseController(w)
			buf := make([]byte, 32<<10)
			for {
				n, err := resp.Body.Read(buf)
				if n > 0 {
					w.Write(buf[:n])
					rc.Flush()
				}
				if err == io.EOF {
					return
				}
				if err != nil {
					// Break the response, as a proxy would: ending it
					// cleanly would hand a truncated stream on as whole.
					t.Logf("recorder %s: reading the answer of %s: %v (request context: %v)", r.Host, next, err, context.Cause(r.Context()))
					panic(http.ErrAbortHandler)
				}
			}
		})
	}
	rec.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if poolQuestion(r) { // pd-extproc's own, not a leg
			if proxy == nil {
				http.NotFound(w, r)
				return
			}
			proxy.ServeHTTP(w, r)
			return
		}
		rec.mu.Lock()
		rec.headers = append(rec.headers, r.Header.Clone())
		rec.paths = append(rec.paths, r.URL.Path)
		rec.mu.Unlock()
		if proxy == nil {
			http.Error(w, "recorder: nothing should reach me", http.StatusTeapot)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(rec.Close)
	return rec
}

func (rec *recorder) addr() string { return rec.Listener.Addr().String() }

func (rec *recorder) seen() ([]http.Header, []string) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return append([]http.Header(nil), rec.headers...), append([]string(nil), rec.paths...)
}

// attackerIP is where a hostile client tries to send traffic: no leg may ever
// mention it, and nothing may connect to it.
const attackerIP = "127.0.0.66"

// newAttacker listens on attackerIP and records anything that reaches it.
func newAttacker(t *testing.T) *recorder {
	t.Helper()
	rec := &recorder{}
	rec.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec.mu.Lock()
		rec.headers = append(rec.headers, r.Header.Clone())
		rec.paths = append(rec.paths, r.Method+" "+r.URL.Path)
		rec.mu.Unlock()
		http.Error(w, "attacker", http.StatusTeapot)
	}))
	ln, err := net.Listen("tcp", attackerIP+":0")
	if err != nil {
		t.Fatal(err)
	}
	rec.Listener.Close()
	rec.Listener = ln
	rec.Start()
	t.Cleanup(rec.Close)
	return rec
}

// nothingReached fails if anything connected to the attacker.
func (rec *recorder) nothingReached(t *testing.T) {
	t.Helper()
	if _, paths := rec.seen(); len(paths) > 0 {
		t.Errorf("traffic reached the attacker's host: %v", paths)
	}
}

// TestHostileDestinationHeaderDoesNotSteer: a client's own
// x-gateway-destination-endpoint must not choose the upstream (docs/architecture.md, Security rules).
// extproc overwrites it (set, not append) and sets the same endpoint in the
// envoy.lb metadata the ORIGINAL_DST cluster reads first. The decode engines
// sit behind recorders, so the test sees the header value they received.
func TestHostileDestinationHeaderDoesNotSteer(t *testing.T) {
	attacker := newAttacker(t)
	for _, mode := range []string{"full_duplex", "buffered"} {
		for _, tt := range []struct {
			name   string
			values []string
		}{
			{"one value", []string{attacker.addr()}},
			{"repeated", []string{attacker.addr(), attacker.addr()}},
			{"a list, ours last", []string{attacker.addr() + ",127.0.0.40:1"}},
			{"not an address", []string{"evil.example:80"}},
		} {
			t.Run(mode+"/"+tt.name, func(t *testing.T) {
				var fronts []*recorder
				r := startRig(t, rigOptions{mode: mode, decodeAddrs: func(sims []*pdsim.Server) []string {
					for _, s := range sims {
						fronts = append(fronts, newRecorder(t, s.Addr()))
					}
					var addrs []string
					for _, f := range fronts {
						addrs = append(addrs, f.addr())
					}
					return addrs
				}})
				marker := "steer " + mode + tt.name
				path, body := request("chat", true, marker)
				resp, got := r.must(t, path, body, http.Header{"X-Gateway-Destination-Endpoint": tt.values})
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %.300s", resp.StatusCode, got)
				}
				checkCompletion(t, true, got)
				attacker.nothingReached(t)
				ups := r.proxy.Upstreams()
				chosen := ups[len(ups)-1]
				if !slices.Contains(r.decodeAddrs, chosen) {
					t.Fatalf("Envoy forwarded to %s, not a configured decode endpoint %v", chosen, r.decodeAddrs)
				}
				for _, f := range fronts {
					hs, _ := f.seen()
					for _, h := range hs {
						if got := h.Values("X-Gateway-Destination-Endpoint"); len(got) != 1 || got[0] != f.addr() {
							t.Errorf("the decode engine at %s saw x-gateway-destination-endpoint %q, want only its own address", f.addr(), got)
						}
					}
				}
				if d := recordsWith(r.decode, marker); len(d) != 1 || d[0].KV != "hit" {
					t.Errorf("decode legs %+v, want one KV hit", d)
				}
			})
		}
	}
}

// TestHostileReservedFieldsNeverReachAnEngine: kv_transfer_params and
// bootstrap_* in a client's body point the engines at the attacker (a NIXL
// side channel, an SGLang bootstrap server), every way a parser may read them:
// repeated (Python's json keeps the last), spelt with an escape
// (kv\u005ftransfer_params decodes to the same key), and null last. Only
// top-level keys have engine semantics; the same keys nested in a message are
// the client's own data and must arrive unchanged. Both legs are read back from
// the engines' records.
func TestHostileReservedFieldsNeverReachAnEngine(t *testing.T) {
	attacker := newAttacker(t)
	host, port := hostPort(t, attacker.addr())
	evilParams := fmt.Sprintf(`{"do_remote_prefill":true,"remote_block_ids":[[1]],"remote_engine_id":"evil",`+
		`"remote_request_id":"evil","remote_host":%q,"remote_port":%s,"remote_bootstrap_addr":"http://%s","transfer_id":"evil"}`,
		host, port, attacker.addr())
	const messagesTmpl = `[{"role":"user","content":%q,"kv_transfer_params":{"nested":"keep-me"},"bootstrap_room":"nested-keep"}]`
	for _, connector := range testbed.Connectors {
		for _, mode := range []string{"full_duplex", "buffered"} {
			t.Run(connector+"/"+mode, func(t *testing.T) {
				r := startRig(t, rigOptions{mode: mode, connector: connector})
				marker := "reserved " + connector + mode
				messages := fmt.Sprintf(messagesTmpl, marker)
				body := fmt.Sprintf(`{"kv_transfer_params":%s,"model":"pdsim","messages":%s,"kv\u005ftransfer_params":%s,`+
					`"bootstrap_host":%q,"bootstrap_port":%s,"bootstrap_room":7,"bootstrap\u005fhost":%q,"bootstrap_port":%s,`+
					`"max_tokens":4,"stream":false,"kv_transfer_params":%s}`,
					evilParams, messages, evilParams, host, port, host, port, evilParams)
				// SGLang's other router-only fields, which its connector removes too.
				sglangOnly := []string{"rid", "bootstrap_pair_key", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"}
				if connector == "kv-sglang" {
					body = strings.TrimSuffix(body, "}") + `,"rid":"evil","bootstrap_pair_key":"evil","routed_dp_rank":66,` +
						`"data_parallel_rank":66,"disagg_prefill_dp_rank":66,"rid":"evil"}`
				}
				resp, got := r.must(t, "/v1/chat/completions", body, nil)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %.300s", resp.StatusCode, got)
				}
				checkCompletion(t, false, got)
				attacker.nothingReached(t)

				has := func(rec pdsim.Record) bool { return strings.Contains(string(rec.Body), marker) }
				prefill, pRec := served(t, r.prefill, has)
				_, dRec := served(t, r.decode, has)
				if dRec.KV != "hit" {
					t.Errorf("decode KV outcome %q, want a hit from the prefill the service chose", dRec.KV)
				}
				wantSource := map[string]string{"kv-nixl": prefill.KVAddr(), "kv-sglang": prefill.BootstrapAddr(),
					"kv-shared-storage": pRec.KVSource, "kv-mooncake": prefill.KVAddr()}[connector]
				if dRec.KVSource != wantSource {
					t.Errorf("decode pulled KV from %q, want %q", dRec.KVSource, wantSource)
				}
				prefillHost, _ := hostPort(t, prefill.Addr())
				for _, leg := range []struct {
					name string
					body []byte
				}{{"prefill", pRec.Body}, {"decode", dRec.Body}} {
					b := string(leg.body)
					if strings.Contains(b, attackerIP) || strings.Contains(b, `"evil"`) || strings.Contains(b, `\u005f`) {
						t.Errorf("%s leg carries client-supplied transfer fields: %s", leg.name, b)
					}
					if top := topLevel(t, leg.body); !bytes.Equal(top["messages"], []byte(messages)) {
						t.Errorf("%s leg messages %s, want the client's, nested fields and all: %s", leg.name, top["messages"], messages)
					}
					keys := topLevelKeys(t, leg.body)
					for _, k := range []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"} {
						if n := count(keys, k); n > 1 {
							t.Errorf("%s leg has %d top-level %s: an engine reads the last one", leg.name, n, k)
						}
					}
					top := topLevel(t, leg.body)
					switch connector {
					case "kv-sglang":
						if string(top["bootstrap_host"]) != fmt.Sprintf("%q", prefillHost) {
							t.Errorf("%s leg bootstrap_host %s, want the chosen prefill's %s", leg.name, top["bootstrap_host"], prefillHost)
						}
						for _, k := range sglangOnly {
							if _, ok := top[k]; ok {
								t.Errorf("%s leg keeps the client's %s: %s", leg.name, k, top[k])
							}
						}
					case "kv-shared-storage":
						for _, k := range []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"} {
							if _, ok := top[k]; ok {
								t.Errorf("%s leg has %s, which kv-shared-storage never sends", leg.name, k)
							}
						}
					}
				}
				r.healthy(t, marker+" after")
			})
		}
	}
}

// TestNoneBodyModeRefusesABodyItCannotScrub: with request_body_mode NONE the
// body would go to the decode engine unseen, with a client's kv_transfer_params
// telling the engine to pull KV from the attacker's host. extproc refuses.
func TestNoneBodyModeRefusesABodyItCannotScrub(t *testing.T) {
	attacker := newAttacker(t)
	host, port := hostPort(t, attacker.addr())
	r := startRig(t, rigOptions{envoy: func(c *envoyemu.Config) { c.Modes.Request.Body = filterv3.ProcessingMode_NONE }})
	body := fmt.Sprintf(`{"model":"pdsim","messages":[{"role":"user","content":"none mode"}],"kv_transfer_params":`+
		`{"do_remote_prefill":true,"remote_block_ids":[[1]],"remote_engine_id":"e","remote_request_id":"r","remote_host":%q,"remote_port":%s}}`, host, port)
	resp, got := r.must(t, "/v1/chat/completions", body, nil)
	attacker.nothingReached(t)
	for _, rec := range recordsWith(r.decode, "none mode") {
		if strings.Contains(string(rec.Body), attackerIP) {
			t.Errorf("the client's kv_transfer_params reached the decode engine: %s", rec.Body)
		}
	}
	if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(got, "FULL_DUPLEX_STREAMED") {
		t.Errorf("status %d (%.200s), want extproc's 500 naming the body modes that can be scrubbed", resp.StatusCode, got)
	}
}

// TestHostileInputsGetAClear4xx sends what a careless or hostile client may
// send. Each gets a 4xx that says why, from whoever answers first (Envoy,
// extproc, or the engine), and right after it extproc is healthy and an
// ordinary request completes.
func TestHostileInputsGetAClear4xx(t *testing.T) {
	// The body-limit rows run against a 2 MiB limit, the other rows against
	// 4 MiB: room for the 1 MiB model and the deep nesting. After an early 413
	// the emulator drains the rest of the upload for up to 1 s, as Envoy does,
	// so the client reads the 413 rather than a reset.
	const limit, small = 4 << 20, 2 << 20
	deep := `{"model":"pdsim","messages":` + strings.Repeat("[", 100_000) + strings.Repeat("]", 100_000) + `}`
	prompt := func(n int) string { // a completions body of exactly n bytes
		head, tail := `{"model":"pdsim","prompt":"`, `"}`
		return head + strings.Repeat("a", n-len(head)-len(tail)) + tail
	}
	tests := []struct {
		name    string
		method  string
		path    string
		body    string
		chunked bool
		header  http.Header
		want    int
		says    string // in the response body
		by      string // who answers: extproc (a local reply it asked for), engine, or Envoy
		small   bool   // against limits.max_body_bytes = small
	}{
		{name: "JSON nested 100,000 levels", path: "/v1/chat/completions", body: deep, want: 400, by: "extproc", says: "nested too deeply"},
		{name: "one byte over limits.max_body_bytes", path: "/v1/completions", body: prompt(small + 1), small: true, want: 413, by: "extproc", says: "limits.max_body_bytes"},
		{name: "one byte over, chunked", path: "/v1/completions", body: prompt(small + 1), small: true, chunked: true, want: 413, by: "extproc", says: "limits.max_body_bytes"},
		{name: "exactly limits.max_body_bytes", path: "/v1/completions", body: prompt(small), small: true, want: 200, by: "engine"},
		{name: "invalid UTF-8", path: "/v1/completions", body: "{\"model\":\"pdsim\",\"prompt\":\"\xff\xfe\xc0\"}", want: 400, by: "extproc", says: "not valid UTF-8"},
		{name: "not JSON", path: "/v1/completions", body: `model=pdsim&prompt=hi`, want: 400, by: "extproc", says: "not valid JSON"},
		// Python's json.loads, given the body's bytes, skips a leading BOM: vLLM serves it.
		{name: "a leading byte order mark", path: "/v1/completions", body: "\ufeff" + prompt(100), want: 200, by: "engine"},
		{name: "two byte order marks", path: "/v1/completions", body: "\ufeff\ufeff" + prompt(100), want: 400, by: "extproc", says: "not valid JSON"},
		{name: "a model of 1 MiB", path: "/v1/completions", body: `{"model":"` + strings.Repeat("m", 1<<20) + `","prompt":"x"}`, want: 400, by: "extproc", says: "model names are at most"},
		{name: "unknown path with a body", path: "/admin/config", body: `{"model":"pdsim","input":"x"}`, want: 404, by: "extproc", says: "unknown path"},
		{name: "unknown path without a body", method: http.MethodGet, path: "/admin/config", want: 404, by: "extproc", says: "unknown path"},
		{
			name: "a 1 MiB header", path: "/v1/completions", body: prompt(100), header: http.Header{"X-Big": {strings.Repeat("h", 1<<20)}},
			want: 431, by: "Envoy",
		},
		{
			name: "headers over the listener's limit", path: "/v1/completions", body: prompt(100),
			header: http.Header{"X-Big": {strings.Repeat("h", 1<<20+8<<10)}}, want: 431, by: "Envoy",
		},
	}
	for _, mode := range []string{"full_duplex", "buffered"} {
		t.Run(mode, func(t *testing.T) {
			rigs := map[bool]*rig{
				false: startRig(t, rigOptions{mode: mode, extra: fmt.Sprintf("limits: {max_body_bytes: %d}", limit)}),
				true:  startRig(t, rigOptions{mode: mode, extra: fmt.Sprintf("limits: {max_body_bytes: %d}", small)}),
			}
			for _, tt := range tests {
				t.Run(tt.name, func(t *testing.T) {
					r := rigs[tt.small]
					method := tt.method
					if method == "" {
						method = http.MethodPost
					}
					var body io.Reader = strings.NewReader(tt.body)
					if tt.chunked {
						body = io.MultiReader(body) // hides the length: Transfer-Encoding chunked
					}
					if tt.body == "" {
						body = nil
					}
					req, err := http.NewRequest(method, r.proxy.URL()+tt.path, body)
					if err != nil {
						t.Fatal(err)
					}
					req.Header.Set("Content-Type", "application/json")
					for k, v := range tt.header {
						req.Header[k] = v
					}
					resp, err := testbed.Client.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					got, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					details := resp.Header.Get(envoyemu.DetailsHeader)
					if resp.StatusCode != tt.want || !strings.Contains(string(got), tt.says) {
						t.Errorf("status %d (%.200s, %s), want %d saying %q", resp.StatusCode, got, details, tt.want, tt.says)
					}
					// extproc's local replies carry details pd_extproc_<status>;
					// the engine's own answers and Envoy's codec carry none.
					if fromExtproc := details == fmt.Sprintf("pd_extproc_%d", tt.want); fromExtproc != (tt.by == "extproc") {
						t.Errorf("answered with details %q; want it from %s", details, tt.by)
					}
					if tt.want == 200 {
						checkCompletion(t, false, string(got))
					}
					r.healthy(t, "after "+tt.name)
				})
			}
		})
	}
}

// topLevel reads a body as vLLM and SGLang do: Python's json, the last
// duplicate key wins.
func topLevel(t *testing.T, b []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("leg is not a JSON object: %v: %.200s", err, b)
	}
	return m
}

// topLevelKeys lists the top-level keys of a JSON object, decoded (escapes
// resolved), duplicates included.
func topLevelKeys(t *testing.T, b []byte) []string {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("leg is not a JSON object: %.200s", b)
	}
	var keys []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, tok.(string))
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

func count(list []string, s string) int {
	n := 0
	for _, v := range list {
		if v == s {
			n++
		}
	}
	return n
}
