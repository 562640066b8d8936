package pipeline_test

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/enginetest"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// storedID is the request_id a stored Responses request's legs carry.
var storedID = regexp.MustCompile(`"request_id":"(resp_[^"]+)"`)

// TestStoredResponseAffinity: a Responses request that the decode engine
// will store is given a response id naming that engine, and every request
// naming the id (previous_response_id, GET, DELETE, cancel) reaches it,
// among three decode endpoints taken in turn.
func TestStoredResponseAffinity(t *testing.T) {
	engine := enginetest.Start(t, enginetest.JSON(200, `{"kv_transfer_params":`+prefillKV+`}`))
	p, _, _ := newPipeline(t, fmt.Sprintf("connector: kv-nixl\npools: {prefill: {endpoints: [%q]}, "+
		"decode: {policy: round-robin, endpoints: [\"10.1.1.1:8000\", \"10.1.1.2:8000\", \"10.1.1.3:8000\"]}}\n", engine.Addr()))
	t.Cleanup(p.Wait) // before newPipeline's: idle connections close once the legs are done
	route := func(method, path, body string) (string, string) {
		t.Helper()
		r := &pipeline.Request{ContentType: "application/json", Method: method, Path: path, RequestID: "r1"}
		var d *pipeline.Decision
		var err error
		if body == "" {
			d, err = p.RouteHeaders(r)
		} else {
			r.Body = []byte(body)
			d, err = p.Route(context.Background(), r)
		}
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		d.Release()
		return r.Report.Decode, string(d.Body.Bytes())
	}

	stored, first := route(http.MethodPost, "/v1/responses", `{"input":"hi"}`)
	m := storedID.FindStringSubmatch(first)
	if m == nil {
		t.Fatalf("decode body %s has no request_id: the response id would say nothing of its engine", first)
	}
	id := m[1]
	if prefill := engine.Requests(); len(prefill) != 1 || !storedID.MatchString(prefill[0].Body) {
		t.Errorf("prefill legs %+v, want one with the same request_id", prefill)
	}

	tests := []struct{ name, method, path, body string }{
		{"a follow-up naming it", http.MethodPost, "/v1/responses", `{"input":"more","previous_response_id":"` + id + `"}`},
		{"GET", http.MethodGet, "/v1/responses/" + id, ""},
		{"GET streamed from a point", http.MethodGet, "/v1/responses/" + id + "?stream=true&starting_after=3", ""},
		{"DELETE", http.MethodDelete, "/v1/responses/" + id, ""},
		{"cancel", http.MethodPost, "/v1/responses/" + id + "/cancel", ""},
		{"cancel with a body", http.MethodPost, "/v1/responses/" + id + "/cancel", `{}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for range 6 { // round-robin would take each endpoint twice
				if got, _ := route(tt.method, tt.path, tt.body); got != stored {
					t.Fatalf("%s %s reached %s, want %s, which stored %s", tt.method, tt.path, got, stored, id)
				}
			}
		})
	}

	// What the id is not given to.
	for _, tt := range []struct{ name, body, want string }{
		{"store false: nothing is stored", `{"input":"hi","store":false}`, `{"input":"hi","store":false,`},
		{"the client's own request_id is its response id", `{"input":"hi","request_id":"mine"}`, `{"input":"hi","request_id":"mine",`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, got := route(http.MethodPost, "/v1/responses", tt.body); !strings.HasPrefix(got, tt.want) ||
				strings.Count(got, `"request_id"`) != strings.Count(tt.body, `"request_id"`) {
				t.Errorf("decode body %s, want %s and the connector's fields", got, tt.want)
			}
		})
	}
}

// TestAStoredResponseIsOfferedOnlyWhereItsIDLeads: with
// pools.decode.fallbacks, Envoy may send a request to any endpoint offered,
// after its body, the response id included, is written. A response stored
// on a fallback under an id naming the pick would be sought on the pick,
// which answers 404: so a request whose response id pd-extproc chooses is
// offered only the endpoint its id names, and a request naming that id
// reaches whichever endpoint Envoy could have sent it to. Others keep their
// fallbacks (kv-shared-storage here: a kv-nixl pull gets none, fallbacks_test.go).
func TestAStoredResponseIsOfferedOnlyWhereItsIDLeads(t *testing.T) {
	engine := enginetest.Start(t, enginetest.JSON(200, `{"id":"x"}`))
	p, _, _ := newPipeline(t, fmt.Sprintf("connector: kv-shared-storage\npools: {prefill: {endpoints: [%q]}, "+
		"decode: {policy: round-robin, fallbacks: 1, endpoints: [\"10.1.1.1:8000\", \"10.1.1.2:8000\", \"10.1.1.3:8000\"]}}\n", engine.Addr()))
	t.Cleanup(p.Wait)
	route := func(body string) *pipeline.Decision {
		t.Helper()
		d, err := p.Route(context.Background(), &pipeline.Request{ContentType: "application/json", Method: http.MethodPost, Path: "/v1/responses", RequestID: "r1", Body: []byte(body)})
		if err != nil {
			t.Fatal(err)
		}
		d.Release()
		return d
	}
	for _, tt := range []struct {
		name, body string
		offered    int // endpoints Envoy may send it to
	}{
		{"stored", `{"input":"hi"}`, 1},
		{"a stored follow-up", `{"input":"hi","previous_response_id":"resp_1"}`, 1},
		{"store false", `{"input":"hi","store":false}`, 2},
		{"the client's own request_id", `{"input":"hi","request_id":"mine"}`, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := route(tt.body)
			if m := storedID.FindSubmatch(d.Body.Bytes()); m != nil {
				for _, servedBy := range d.Endpoints { // where Envoy may have sent it, and the engine stored it
					if got := route(`{"input":"more","previous_response_id":"` + string(m[1]) + `"}`).Endpoints[0]; got != servedBy {
						t.Errorf("a follow-up naming %s reached %s; the response may be stored on %s", m[1], got, servedBy)
					}
				}
			}
			if len(d.Endpoints) != tt.offered {
				t.Errorf("offered %q, want %d endpoints", d.Endpoints, tt.offered)
			}
		})
	}
}
