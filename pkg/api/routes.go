package api

import (
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
)

// Route is one entry of the pass-through list: requests with this method to
// this path go to a decode engine alone, their body (JSON only) scrubbed of
// the reserved fields. Written "METHOD /path"; a path ending in "/*" admits
// every path below it.
type Route struct {
	Method string
	Path   string // without the "*" of a prefix
	Prefix bool
}

func (r Route) String() string {
	if r.Prefix {
		return r.Method + " " + r.Path + "*"
	}
	return r.Method + " " + r.Path
}

// DefaultPassthrough is the pass-through list of a config that sets none:
// the engine endpoints clients call besides inference, of vLLM and of
// SGLang, and the stored responses of the Responses API. Engine admin and
// debug endpoints (cache flushes, profiling, sleep, weight updates) are
// deliberately absent. A user's routes.passthrough replaces it whole.
var DefaultPassthrough = []string{
	"POST /v1/embeddings",
	"POST /pooling",
	"POST /classify",
	"POST /v1/classify",
	"POST /score",
	"POST /v1/score",
	"POST /rerank",
	"POST /v1/rerank",
	"POST /v2/rerank",
	"POST /tokenize",
	"POST /detokenize",
	"POST /v1/tokenize",
	"POST /v1/detokenize",
	"POST /v1/messages/count_tokens", // vLLM's Anthropic API; Claude clients call it at start
	"GET /v1/models",
	"GET /v1/models/*",
	"GET /health",
	"GET /get_model_info",
	"GET /v1/responses/*",
	"DELETE /v1/responses/*",
	"POST /v1/responses/*",
}

// ModelsPath is the OpenAI model list; GET ModelsPath/{model} retrieves one.
const ModelsPath = "/v1/models"

// Models reads a request of the OpenAI model API by its method and path
// (without query): the list (list), or the retrieval of model; neither for
// any other request.
func Models(method, path string) (list bool, model string) {
	if method != "GET" {
		return false, ""
	}
	if name, ok := strings.CutPrefix(path, ModelsPath+"/"); ok {
		model, _ = url.PathUnescape(name)
		return false, model
	}
	return path == ModelsPath, ""
}

// methods are those an entry may name.
var methods = []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"}

// ParseRoute reads one entry of the pass-through list.
func ParseRoute(s string) (Route, error) {
	method, path, ok := strings.Cut(s, " ")
	if !ok || !slices.Contains(methods, method) {
		return Route{}, fmt.Errorf("%q is not \"METHOD /path\" with METHOD one of %s", s, strings.Join(methods, ", "))
	}
	r := Route{Method: method, Path: path}
	if strings.HasSuffix(path, "/*") {
		r.Path, r.Prefix = strings.TrimSuffix(path, "*"), true
	}
	switch {
	case r.Path == "/":
		return Route{}, fmt.Errorf("%q admits every path", s)
	case !Safe(r.Path) || strings.ContainsAny(r.Path, " \t"):
		return Route{}, fmt.Errorf("%q: a path starts with / and has no space, \"..\", \"//\", backslash or percent-encoded / . or \\", s)
	case strings.ContainsAny(r.Path, "*?#"):
		return Route{}, fmt.Errorf("%q: a path has no query, and only a last \"/*\" as a wildcard", s)
	}
	if a := builtinAt(r.Path); a != nil && !r.Prefix && a.Method == r.Method {
		return Route{}, fmt.Errorf("%q is an API pd-extproc routes itself", s)
	}
	return r, nil
}

// Safe reports whether path (no query) is one the table may admit: it starts
// with / and has no dot segment, no empty segment, no backslash and none of
// their percent-encodings, any of which an engine or a proxy between could
// resolve into a path the table never admitted.
func Safe(path string) bool {
	if !strings.HasPrefix(path, "/") || strings.Contains(path, "..") || strings.Contains(path, "//") || strings.Contains(path, `\`) {
		return false
	}
	for i := strings.IndexByte(path, '%'); i >= 0; i = strings.IndexByte(path, '%') {
		if len(path) >= i+3 {
			switch strings.ToLower(path[i+1 : i+3]) {
			case "2f", "2e", "5c":
				return false
			}
		}
		path = path[i+1:]
	}
	return true
}

// Table is what a deployment routes: the built-in APIs and its pass-through
// list. It is read-only once built.
type Table struct {
	pass  []Route
	alone map[*API]*API // built-in APIs sent to a decode engine alone, and their unpaired copies
}

// NewTable builds the table with the pass-through list pass. The built-in
// APIs in decodeOnly are routed as APIs no engine family can disaggregate
// (routes.messages_decode_only: an engine too old to hand the KV back).
func NewTable(pass []Route, decodeOnly ...*API) *Table {
	t := &Table{pass: slices.Clone(pass), alone: map[*API]*API{}}
	for _, a := range decodeOnly {
		unpaired := *a
		unpaired.Pairs = 0
		t.alone[a] = &unpaired
	}
	return t
}

// ParseRoutes reads a pass-through list; errors name each entry as key[i].
func ParseRoutes(key string, entries []string) ([]Route, error) {
	routes := make([]Route, 0, len(entries))
	var errs []error
	seen := map[Route]bool{}
	for i, s := range entries {
		r, err := ParseRoute(s)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("%s[%d]: %w", key, i, err))
			continue
		case seen[r]:
			errs = append(errs, fmt.Errorf("%s[%d]: %q is listed twice", key, i, s))
		}
		seen[r] = true
		routes = append(routes, r)
	}
	return routes, errors.Join(errs...)
}

// MatchError says why the table admits no request with this method and path.
type MatchError struct {
	Method, Path string // the path without its query
	Unsafe       bool   // the path is not Safe
	Allowed      []string
}

func (e *MatchError) Error() string {
	switch {
	case e.Unsafe:
		return fmt.Sprintf("path %q is refused: it has a dot or empty segment, a backslash or an encoded / . or \\", e.Path)
	case len(e.Allowed) > 0:
		return fmt.Sprintf("%s %s is not routed; this path takes %s", e.Method, e.Path, strings.Join(e.Allowed, ", "))
	}
	return fmt.Sprintf("unknown path %q", e.Path)
}

// Match finds the API of a request: a built-in one, or the pass-through API
// when the list admits it. path may carry a query; it is not matched.
func (t *Table) Match(method, path string) (*API, error) {
	path = stripQuery(path)
	if !Safe(path) {
		return nil, &MatchError{Method: method, Path: path, Unsafe: true}
	}
	var allowed []string
	if a := builtinAt(path); a != nil {
		if a.Method == method {
			if unpaired, ok := t.alone[a]; ok {
				return unpaired, nil
			}
			return a, nil
		}
		allowed = append(allowed, a.Method)
	}
	for _, r := range t.pass {
		if !r.admits(path) {
			continue
		}
		if r.Method == method {
			return passthrough, nil
		}
		allowed = append(allowed, r.Method)
	}
	slices.Sort(allowed)
	return nil, &MatchError{Method: method, Path: path, Allowed: slices.Compact(allowed)}
}

// admits reports whether the entry's path takes path: the same path, or for
// a prefix entry one with something below it.
func (r Route) admits(path string) bool {
	if r.Prefix {
		return len(path) > len(r.Path) && strings.HasPrefix(path, r.Path)
	}
	return path == r.Path
}

// IsPassthrough reports whether a is the API of the pass-through list.
func (a *API) IsPassthrough() bool { return a == passthrough }

func stripQuery(path string) string {
	path, _, _ = strings.Cut(path, "?")
	return path
}
