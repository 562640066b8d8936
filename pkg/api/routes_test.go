package api

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// Engine admin and debug endpoints of vLLM and SGLang: never reachable
// through the gateway, whatever the method.
var adminPaths = []string{
	"/flush_cache", "/start_profile", "/stop_profile", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache",
	"/collective_rpc", "/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_tensor",
	"/init_weights_update_group", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/load_lora_adapter",
	"/pause_generation", "/continue_generation", "/abort_request", "/abort_requests", "/configure_logging",
	"/set_internal_state", "/get_server_info", "/scale_elastic_ep", "/server_info", "/metrics",
}

func defaultTable(t *testing.T) *Table {
	t.Helper()
	routes, err := ParseRoutes("routes.passthrough", DefaultPassthrough)
	if err != nil {
		t.Fatal(err)
	}
	return NewTable(routes)
}

func TestMatch(t *testing.T) {
	table := defaultTable(t)
	tests := []struct {
		method, path string
		want         *API   // nil: refused
		why          string // in the refusal
	}{
		{"POST", "/v1/chat/completions", Chat, ""},
		{"POST", "/v1/chat/completions?stream=1", Chat, ""},
		{"POST", "/v1/completions", Completions, ""},
		{"POST", "/v1/responses", Responses, ""},
		{"POST", "/inference/v1/generate", Generate, ""},
		{"POST", "/generate", SGLangGenerate, ""},
		{"POST", "/v1/messages", Messages, ""},
		{"POST", "/v1/embeddings", passthrough, ""},
		{"GET", "/v1/models", passthrough, ""},
		{"GET", "/v1/models/qwen", passthrough, ""},
		{"GET", "/v1/responses/resp_1", passthrough, ""},
		{"POST", "/v1/responses/resp_1/cancel", passthrough, ""},
		{"DELETE", "/v1/responses/resp_1", passthrough, ""},
		{"GET", "/v1/chat/completions", nil, "takes POST"},
		{"PUT", "/v1/models", nil, "takes GET"},
		{"POST", "/v1/chat/completions/", nil, "unknown path"},
		{"POST", "/V1/chat/completions", nil, "unknown path"},
		{"GET", "/v1/responses/", nil, "unknown path"},
		{"GET", "/v1/responses", nil, "takes POST"},
		{"GET", "/v1/models/../../sleep", nil, "is refused"},
		{"GET", "/v1/models/x/%2e%2e/%2E%2E/sleep", nil, "is refused"},
		{"GET", "/v1/models/x%2fy", nil, "is refused"},
		{"GET", "/v1/models/x%5Cy", nil, "is refused"},
		{"GET", `/v1/models/x\y`, nil, "is refused"},
		{"POST", "//v1/embeddings", nil, "is refused"},
		{"POST", "v1/embeddings", nil, "is refused"},
		{"POST", "", nil, "is refused"},
		{"GET", "/v1/models/a%20b", passthrough, ""}, // other escapes name nothing new
	}
	for _, path := range adminPaths {
		for _, m := range methods {
			tests = append(tests, struct {
				method, path string
				want         *API
				why          string
			}{m, path, nil, ""})
		}
	}
	for _, tt := range tests {
		a, err := table.Match(tt.method, tt.path)
		if a != tt.want {
			t.Errorf("Match(%s %q) = %v, %v; want %v", tt.method, tt.path, a, err, tt.want)
			continue
		}
		var me *MatchError
		if tt.want == nil && (!errors.As(err, &me) || !strings.Contains(err.Error(), tt.why)) {
			t.Errorf("Match(%s %q) error %v, want a *MatchError saying %q", tt.method, tt.path, err, tt.why)
		}
	}
}

func TestParseRoute(t *testing.T) {
	tests := []struct {
		in   string
		want Route
		err  string
	}{
		{in: "GET /v1/models", want: Route{Method: "GET", Path: "/v1/models"}},
		{in: "DELETE /v1/responses/*", want: Route{Method: "DELETE", Path: "/v1/responses/", Prefix: true}},
		{in: "/v1/models", err: "METHOD /path"},
		{in: "get /v1/models", err: "METHOD /path"},
		{in: "GET  /v1/models", err: "starts with /"},
		{in: "GET /*", err: "admits every path"},
		{in: "GET /v1/*/x", err: "wildcard"},
		{in: "GET /v1/models*", err: "wildcard"},
		{in: "GET /v1/models?x=1", err: "no query"},
		{in: "GET /v1/../flush_cache", err: "starts with /"},
		{in: "GET /v1/x%2F", err: "percent-encoded"},
		{in: "POST /v1/completions", err: "routes itself"},
	}
	for _, tt := range tests {
		got, err := ParseRoute(tt.in)
		switch {
		case tt.err == "" && (err != nil || got != tt.want):
			t.Errorf("ParseRoute(%q) = %+v, %v; want %+v", tt.in, got, err, tt.want)
		case tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)):
			t.Errorf("ParseRoute(%q) error %v, want one saying %q", tt.in, err, tt.err)
		}
		if err == nil && got.String() != tt.in {
			t.Errorf("ParseRoute(%q).String() = %q", tt.in, got.String())
		}
	}
}

func TestLabelsAreClosed(t *testing.T) {
	labels := Labels()
	if want := len(Builtin) + 2; len(labels) != want || len(slices.Compact(slices.Sorted(slices.Values(labels)))) != want {
		t.Fatalf("Labels() = %q: want each built-in API, passthrough and other, once", labels)
	}
	for req, want := range map[[2]string]string{
		{"POST", "/v1/responses?x=1"}: NameResponses, {"POST", "/generate"}: NameSGLangGenerate, {"POST", "/v1/embeddings"}: Other,
		{"GET", "/anything/at/all"}: Other, {"GET", "/v1/chat/completions"}: Other,
	} {
		if got := LabelOf(req[0], req[1]); got != want {
			t.Errorf("LabelOf(%q, %q) = %q, want %q", req[0], req[1], got, want)
		}
	}
}

// The OpenAI model API, read by method and path: the list, a model's
// retrieval (its name unescaped, as a model may be named org/model), or
// neither.
func TestModels(t *testing.T) {
	tests := []struct {
		method, path string
		list         bool
		model        string
	}{
		{"GET", "/v1/models", true, ""},
		{"GET", "/v1/models/llama", false, "llama"},
		{"GET", "/v1/models/org%2Fmodel", false, "org/model"},
		{"GET", "/v1/models/org/model", false, "org/model"},
		{"POST", "/v1/models", false, ""},
		{"GET", "/v1/modelsx", false, ""},
		{"GET", "/v1/chat/completions", false, ""},
	}
	for _, tt := range tests {
		if list, model := Models(tt.method, tt.path); list != tt.list || model != tt.model {
			t.Errorf("Models(%s %s) = %v, %q; want %v, %q", tt.method, tt.path, list, model, tt.list, tt.model)
		}
	}
}
