package pdsim

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// tokenIDs is what /tokenize answers for body.
func tokenIDs(t *testing.T, s *Server, body string) []uint64 {
	t.Helper()
	r := post(t, s, "/tokenize", body, "")
	var a tokenizeResponse
	if err := json.Unmarshal(r.body, &a); err != nil || r.status != 200 || a.Count != len(a.Tokens) {
		t.Fatalf("/tokenize %s: %d %s", body, r.status, r.body)
	}
	return a.Tokens
}

// /tokenize answers the ids the engine caches the same prompt under when it
// serves it: all of its full blocks are in the cache afterwards.
func TestTokenizeAsTheCacheDoes(t *testing.T) {
	msgs, _ := json.Marshal(turn2)
	tests := []struct {
		name, tokenize string
		serve          string // the inference request, path and body
		body           string
	}{
		{"a completion's prompt", `{"model":"pdsim","prompt":"` + words("w", 40) + `"}`,
			"/v1/completions", `{"model":"pdsim","prompt":"` + words("w", 40) + `"}`},
		{"token ids stay themselves", `{"prompt":` + ids(1, 40) + `}`,
			"/v1/completions", `{"prompt":` + ids(1, 40) + `}`},
		{"chat messages", `{"model":"pdsim","messages":` + string(msgs) + `}`,
			"/v1/chat/completions", chatOf("", turn2...)},
		{"chat messages with tools and no generation prompt",
			`{"messages":` + string(msgs) + `,"add_generation_prompt":false,"tools":[{"type":"function","function":{"name":"f"}}]}`,
			"/v1/chat/completions", chatOf(`,"tools":[{"type":"function","function":{"name":"f"}}]`, turn2...)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := start(t, Config{})
			got := tokenIDs(t, d, tt.tokenize)
			if r := post(t, d, tt.serve, tt.body, ""); r.status != 200 {
				t.Fatalf("%s: %d %s", tt.serve, r.status, r.body)
			}
			hs := blockHashes("pdsim", blockKeys{}, got)
			if len(hs) < 2 || d.metrics.cache.match(hs) != len(hs) {
				t.Errorf("the cache lacks the blocks of /tokenize's ids %v", got)
			}
			if tt.name == "token ids stay themselves" && (got[0] != 1 || got[39] != 40) {
				t.Errorf("ids %v", got)
			}
			for _, id := range got {
				if id >= vocabulary {
					t.Errorf("id %d is not below 2^31", id)
				}
			}
		})
	}
}

func TestTokenizeAnswers(t *testing.T) {
	d := start(t, Config{})
	tests := []struct {
		path, body string
		status     int
		want       string // in the body
	}{
		{"/tokenize", `{"prompt":"a b c"}`, 200, `{"count":3,"max_model_len":32768,"tokens":[`},
		{"/tokenize", `{"prompt":"a b c"}`, 200, `],"token_strs":null}`},
		{"/tokenize", `{"prompt":""}`, 200, `"tokens":[]`},
		{"/tokenize", `{"model":"other","prompt":"a"}`, 404, "The model `other` does not exist."},
		{"/tokenize", `{"model":"pdsim"}`, 400, "prompt: Field required"},
		{"/tokenize", `{"messages":[]}`, 400, "messages: Input should be a non-empty list"},
		{"/tokenize", `[1,2]`, 400, "JSON decode error"},
	}
	for _, tt := range tests {
		r := post(t, d, tt.path, tt.body, "")
		if r.status != tt.status || !strings.Contains(string(r.body), tt.want) {
			t.Errorf("POST %s %s: %d %s; want %d with %q", tt.path, tt.body, r.status, r.body, tt.status, tt.want)
		}
	}
	recs := d.Requests()
	if len(recs) != len(tests) || recs[0].Path != "/tokenize" || recs[0].Status != 200 || string(recs[0].Body) != tests[0].body {
		t.Errorf("records %+v: want every request recorded", recs)
	}
	if a, b := tokenIDs(t, d, `{"prompt":"a b c"}`), tokenIDs(t, d, `{"prompt":"a b c d"}`); !reflect.DeepEqual(a, b[:3]) {
		t.Errorf("a prompt's ids %v do not start its extension's %v", a, b)
	}
}

// TestRenderAsTheEndpointDoes: the render endpoints answer the ids their
// endpoint caches the request under, the fields its template renders beside
// the messages (documents, reasoning_effort) included; /tokenize, which
// vLLM does not give them, answers other ids for such a request. A request
// the endpoint refuses is refused alike; without render endpoints (older
// vLLM, SGLang) the paths are not found.
func TestRenderAsTheEndpointDoes(t *testing.T) {
	msgs, _ := json.Marshal(turn2)
	tests := []struct {
		name, path, body string
		serve            string // the inference request's path
		list             bool   // completions render a list, one per prompt
		likeTokenize     bool   // /tokenize answers the same ids
		noTokenize       bool   // /tokenize has no form of it
	}{
		{"a completion's prompt", "/v1/completions/render", `{"model":"pdsim","prompt":"` + words("w", 40) + `"}`, "/v1/completions", true, true, false},
		{"chat messages", "/v1/chat/completions/render", `{"model":"pdsim","messages":` + string(msgs) + `}`, "/v1/chat/completions", false, true, false},
		{"chat with reasoning_effort and documents", "/v1/chat/completions/render",
			`{"model":"pdsim","messages":` + string(msgs) + `,"reasoning_effort":"low","documents":[{"text":"d"}]}`, "/v1/chat/completions", false, false, false},
		{"a Responses input", "/v1/responses/render", `{"model":"pdsim","input":"` + words("w", 40) + `"}`, "/v1/responses", false, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := start(t, Config{})
			r := post(t, d, tt.path, tt.body, "")
			raw := r.body
			if tt.list {
				var list []json.RawMessage
				if err := json.Unmarshal(raw, &list); err != nil || len(list) != 1 {
					t.Fatalf("%s: %d %s, want a list of one", tt.path, r.status, r.body)
				}
				raw = list[0]
			}
			var rendered struct {
				TokenIDs []uint64 `json:"token_ids"`
			}
			if err := json.Unmarshal(raw, &rendered); err != nil || r.status != 200 {
				t.Fatalf("%s: %d %s", tt.path, r.status, r.body)
			}
			if s := post(t, d, tt.serve, tt.body, ""); s.status != 200 {
				t.Fatalf("%s: %d %s", tt.serve, s.status, s.body)
			}
			if hs := blockHashes("pdsim", blockKeys{}, rendered.TokenIDs); len(hs) < 2 || d.metrics.cache.match(hs) != len(hs) {
				t.Errorf("the cache lacks the blocks of the rendered ids")
			}
			if tt.noTokenize {
				return
			}
			if same := reflect.DeepEqual(tokenIDs(t, d, tt.body), rendered.TokenIDs); same != tt.likeTokenize {
				t.Errorf("/tokenize answers the rendered ids: %v, want %v", same, tt.likeTokenize)
			}
		})
	}
	d := start(t, Config{})
	if r := post(t, d, "/v1/chat/completions/render", `{"model":"pdsim","messages":[]}`, ""); r.status != 400 {
		t.Errorf("empty messages rendered: %d %s", r.status, r.body)
	}
	for _, cfg := range []Config{{NoRender: true}, {Protocol: ProtocolSGLang}} {
		if r := post(t, start(t, cfg), "/v1/chat/completions/render", `{"model":"pdsim","messages":[{"role":"user","content":"hi"}]}`, ""); r.status != 404 {
			t.Errorf("%+v: render answered %d, want 404", cfg, r.status)
		}
	}
}

// SGLang's /tokenize takes a prompt, not chat messages (TokenizeRequest).
func TestSGLangTokenizeTakesPromptsOnly(t *testing.T) {
	d := start(t, Config{Protocol: ProtocolSGLang})
	if r := post(t, d, "/v1/tokenize", `{"messages":[{"role":"user","content":"hi"}]}`, ""); r.status != 400 {
		t.Errorf("messages: %d %s, want 400", r.status, r.body)
	}
	if r := post(t, d, "/v1/tokenize", `{"prompt":"a b c"}`, ""); r.status != 200 {
		t.Errorf("a prompt: %d %s, want 200", r.status, r.body)
	}
}
