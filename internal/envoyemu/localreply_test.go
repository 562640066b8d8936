package envoyemu

import (
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestLocalReplyConfig is §15 as the shipped envoy.yaml configures it:
// Envoy's own replies, each with a response flag, and the ext_proc filter's
// failures reach the client in OpenAI's error JSON, or in Anthropic's on
// /v1/messages and below; the processor's immediate responses pass as they
// are.
func TestLocalReplyConfig(t *testing.T) {
	const refused = "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure, transport failure reason: delayed connect error: Connection refused"
	const procJSON = `{"error":{"message":"no capacity","type":"service_unavailable","code":503}}`
	immediate := func(body string, hs ...*corev3.HeaderValueOption) func(*procStream) error {
		return func(s *procStream) error {
			s.next()
			s.reply(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
				Status: &typev3.HttpStatus{Code: typev3.StatusCode_ServiceUnavailable}, Body: []byte(body),
				Headers: &extprocv3.HeaderMutation{SetHeaders: hs},
			}}})
			return nil
		}
	}
	hanging := startUpstreamWith(t, func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	tests := []struct {
		name    string
		plain   bool // without local_reply_config: Envoy's defaults
		idle    time.Duration
		timeout time.Duration // the message timer, with envoy-buffered.yaml (FULL_DUPLEX has none)
		upAddr  string        // where the processor routes; "" for the refusing address
		script  func(*procStream) error
		path    string // "" for /v1/completions
		status  int
		body    string
		ctype   string
		details string
	}{
		{name: "an engine that refuses the connection (UF)", status: 503,
			body: envoyError(503, refused, "upstream_error"), ctype: "application/json"},
		{name: "the same without local_reply_config", plain: true, status: 503, body: refused, ctype: "text/plain"},
		{name: "the same to chat completions", path: "/v1/chat/completions", status: 503,
			body: envoyError(503, refused, "upstream_error"), ctype: "application/json"},
		// Anthropic's clients get Anthropic's shape, the type Anthropic gives the status.
		{name: "the same to the Messages API", path: "/v1/messages?beta=true", status: 503,
			body: anthropicError(refused, "overloaded_error"), ctype: "application/json"},
		{name: "the same below the Messages API", path: "/v1/messages/count_tokens", status: 503,
			body: anthropicError(refused, "overloaded_error"), ctype: "application/json"},
		{name: "the same to a path that only starts like it", path: "/v1/messagesx", status: 503,
			body: envoyError(503, refused, "upstream_error"), ctype: "application/json"},
		{name: "an idle stream to the Messages API", path: "/v1/messages", idle: 100 * time.Millisecond, upAddr: hanging.addr, status: 504,
			body: anthropicError("stream timeout", "timeout_error"), ctype: "application/json"},
		{name: "the processor's immediate response to the Messages API", path: "/v1/messages",
			script: immediate(procJSON, rawHeader("content-type", "application/json")), status: 503, body: procJSON, ctype: "application/json"},
		{name: "the processor failing, to the Messages API", path: "/v1/messages?beta=true", script: func(s *procStream) error {
			s.next()
			return status.Error(codes.Unavailable, "down")
		}, status: 500, ctype: "application/json",
			body: anthropicError("request processing failed: ext_proc_error_gRPC_error_14{down}", "api_error")},
		{name: "the processor too slow, to the Messages API", path: "/v1/messages", timeout: 50 * time.Millisecond, script: func(s *procStream) error {
			s.next()
			<-s.Context().Done()
			return nil
		}, status: 504, ctype: "application/json",
			body: anthropicError("request processing failed: ext_proc_error_per-message_timeout_exceeded", "timeout_error")},
		{name: "a stream idle past its timeout (SI)", idle: 100 * time.Millisecond, upAddr: hanging.addr, status: 504,
			body: envoyError(504, "stream timeout", "timeout_error"), ctype: "application/json"},
		{name: "the processor's immediate response", script: immediate(procJSON, rawHeader("content-type", "application/json")),
			status: 503, body: procJSON, ctype: "application/json"},
		{name: "the processor's immediate response in text", script: immediate("busy"), status: 503, body: "busy", ctype: "text/plain"},
		{name: "the processor failing", script: func(s *procStream) error {
			s.next()
			return status.Error(codes.Unavailable, "down")
		}, status: 500, details: "ext_proc_error_gRPC_error_14{down}", ctype: "application/json",
			body: envoyError(500, "request processing failed: ext_proc_error_gRPC_error_14{down}", "server_error")},
		{name: "the processor too slow", timeout: 50 * time.Millisecond, script: func(s *procStream) error {
			s.next()
			<-s.Context().Done()
			return nil
		}, status: 504, details: "ext_proc_error_per-message_timeout_exceeded", ctype: "application/json",
			body: envoyError(504, "request processing failed: ext_proc_error_per-message_timeout_exceeded", "server_error")},
		{name: "the processor failing, without local_reply_config", plain: true, script: func(s *procStream) error {
			s.next()
			return status.Error(codes.Unavailable, "down")
		}, status: 500, details: "ext_proc_error_gRPC_error_14{down}"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			file := "envoy.yaml"
			if tc.timeout > 0 {
				file = "envoy-buffered.yaml"
			}
			cfg := loadShipped(t, file)
			if tc.plain {
				cfg.LocalReplies = LocalReplies{}
			}
			if tc.idle > 0 {
				cfg.Limits.StreamIdleTimeout = tc.idle
			}
			if tc.timeout > 0 {
				cfg.Failure.MessageTimeout = tc.timeout
			}
			up := tc.upAddr
			if up == "" {
				up = refusingAddr(t)
			}
			script := tc.script
			if script == nil {
				script = fullDuplexRouter(setHeaders(rawHeader("x-gateway-destination-endpoint", up)), nil, nil)
			}
			p := startProxy(t, cfg, script)
			path := tc.path
			if path == "" {
				path = "/v1/completions"
			}
			res := do(t, p, http.MethodPost, path, `{"model":"m"}`, nil)
			if res.status != tc.status || res.body != tc.body || res.header.Get("Content-Type") != tc.ctype {
				t.Errorf("response = %d %q (%s), want %d %q (%s)", res.status, res.body, res.header.Get("Content-Type"), tc.status, tc.body, tc.ctype)
			}
			if tc.details != "" && res.header.Get(DetailsHeader) != tc.details {
				t.Errorf("details = %q, want %q", res.header.Get(DetailsHeader), tc.details)
			}
		})
	}
}

// celMapper is a mapper whose filter is the CEL expression expr, setting
// status (0: none).
func celMapper(expr string, status int) string {
	m := `
            - filter:
                extension_filter:
                  name: envoy.access_loggers.extension_filters.cel
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter
                    expression: ` + expr + "\n"
	if status != 0 {
		m += "              status_code: " + strconv.Itoa(status) + "\n"
	}
	return m
}

// messagesMapper is a mapper that answers "messages" to a reply with flag
// UF whose request's :path matches the string matcher match.
func messagesMapper(match string) string {
	return `
            - filter:
                and_filter:
                  filters:
                  - header_filter: {header: {name: ":path", string_match: ` + match + `}}
                  - response_flag_filter: {flags: [UF]}
              body: {inline_string: messages}
`
}

// refusingAddr is a loopback address where nothing listens: a socket bound
// there and never listening, so that the kernel refuses connections and no
// other listener of the test (the proxy's own) can take the port.
func refusingAddr(t *testing.T) string {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
}

// TestLocalReplyConfigLoad: the emulator takes the local_reply_config it
// can evaluate and refuses the rest, with what Envoy itself refuses.
func TestLocalReplyConfigLoad(t *testing.T) {
	const anchor = "            mappers:\n"
	tests := []struct {
		name     string
		mappers  string // replaces the shipped mappers
		wantErr  string // "" for a config that loads
		path     string // the request's :path ("" for no request headers)
		code     int    // then what a 503 "refused" with flag UF becomes
		body, ct string
	}{
		{name: "text format with its content type", mappers: `
            - filter: {response_flag_filter: {flags: [UF, UH]}}
              status_code: 502
              body_format_override:
                text_format_source: {inline_string: "%RESPONSE_CODE% %LOCAL_REPLY_BODY% (%RESPONSE_FLAGS%)"}
                content_type: text/html
`, code: 502, body: "502 refused (UF)", ct: "text/html"},
		{name: "JSON format: numbers, typed operators, text", mappers: `
            - filter: {response_flag_filter: {flags: [UF]}}
              body: {inline_string: refused at once}
              body_format_override:
                json_format: {retry: 1, code: "%RESPONSE_CODE%", details: "%RESPONSE_CODE_DETAILS%", what: "%RESPONSE_FLAGS%: %LOCAL_REPLY_BODY%"}
`, code: 503, body: `{"code":503,"details":"upstream_reset_before_response_started{connection_failure}","retry":1,"what":"UF: refused at once"}` + "\n", ct: "application/json"},
		{name: "a CEL filter on the details and the status", mappers: celMapper(`response.code == 503 && response.code_details.startsWith('upstream_reset')`, 502), code: 502, body: "refused", ct: "text/plain"},
		{name: "a CEL filter whose expression errs matches nothing", mappers: celMapper(`response.code / 0 == 1 || response.code_details`, 502), code: 503, body: "refused", ct: "text/plain"},
		{name: "a CEL macro's own variable", mappers: celMapper(`response.code == 503 && [{'x':1}].exists(m, m.x == 1)`, 502), code: 502, body: "refused", ct: "text/plain"},
		{name: "a CEL expression that does not parse", mappers: celMapper(`response.code ==`, 0), wantErr: "Syntax error"},
		{name: "a CEL attribute it does not give", mappers: celMapper(`response.headers['x'] == 'y'`, 0), wantErr: "response.headers is not emulated"},
		{name: "a CEL attribute read by index", mappers: celMapper(`response['code'] == 503`, 0), wantErr: "response[...] is not emulated"},
		{name: "an attribute outside response", mappers: celMapper(`request.path == '/'`, 0), wantErr: "undeclared reference to 'request'"},
		{name: "a path prefix and flags", path: "/v1/messages?beta=true", mappers: messagesMapper(`{prefix: /v1/messages}`), code: 503, body: "messages", ct: "text/plain"},
		{name: "a path prefix, another path", path: "/v1/chat/completions", mappers: messagesMapper(`{prefix: /v1/messages}`), code: 503, body: "refused", ct: "text/plain"},
		{name: "a path prefix, no request headers", mappers: messagesMapper(`{prefix: /v1/messages}`), code: 503, body: "refused", ct: "text/plain"},
		{name: "a regex matches the whole path", path: "/v1/messages/count_tokens", mappers: messagesMapper(`{safe_regex: {regex: "/v1/messages([/?].*)?"}}`), code: 503, body: "messages", ct: "text/plain"},
		{name: "a regex matches the whole path, not a part", path: "/v1/messagesx", mappers: messagesMapper(`{safe_regex: {regex: "/v1/messages([/?].*)?"}}`), code: 503, body: "refused", ct: "text/plain"},
		{name: "an exact match ignoring case", path: "/V1/Messages", mappers: messagesMapper(`{exact: /v1/messages, ignore_case: true}`), code: 503, body: "messages", ct: "text/plain"},
		{name: "an inverted match", path: "/v1/chat/completions", mappers: strings.Replace(messagesMapper(`{prefix: /v1/messages}`), "string_match", "invert_match: true, string_match", 1), code: 503, body: "messages", ct: "text/plain"},
		{name: "an inverted match without the header", mappers: strings.Replace(messagesMapper(`{prefix: /v1/messages}`), "string_match", "invert_match: true, string_match", 1), code: 503, body: "refused", ct: "text/plain"},
		{name: "or: either filter", path: "/v1/chat/completions", mappers: strings.Replace(messagesMapper(`{prefix: /v1/messages}`), "and_filter", "or_filter", 1), code: 503, body: "messages", ct: "text/plain"},
		{name: "a header matcher other than string_match", mappers: strings.Replace(messagesMapper(""), "string_match: ", "present_match: true", 1), wantErr: "only a string_match header matcher is emulated"},
		{name: "an and_filter of one filter, which Envoy refuses", mappers: `
            - filter: {and_filter: {filters: [{response_flag_filter: {}}]}}
              body: {inline_string: x}
`, wantErr: "value must contain at least 2 item(s)"},
		{name: "a filter other than those", mappers: `
            - filter: {status_code_filter: {comparison: {op: GE, value: {default_value: 500, runtime_key: k}}}}
              body: {inline_string: x}
`, wantErr: "only response_flag_filter, header_filter, and_filter, or_filter and the CEL extension_filter are emulated"},
		{name: "headers to add", mappers: `
            - filter: {response_flag_filter: {}}
              headers_to_add: [{header: {key: a, value: b}}]
`, wantErr: "headers_to_add is not emulated"},
		{name: "an operator it does not know", mappers: `
            - filter: {response_flag_filter: {}}
              body_format_override: {json_format: {at: "%START_TIME%"}}
`, wantErr: "%START_TIME% is not emulated"},
		{name: "a boolean in a JSON format, which Envoy refuses", mappers: `
            - filter: {response_flag_filter: {}}
              body_format_override: {json_format: {retry: true}}
`, wantErr: "only string values"},
	}
	raw, err := os.ReadFile(filepath.Join(repoRoot(t), "config", "envoy", "envoy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	shipped := string(raw)
	start := strings.Index(shipped, anchor) + len(anchor)
	end := start + strings.Index(shipped[start:], "          route_config:\n")
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "envoy.yaml")
			if err := os.WriteFile(path, []byte(shipped[:start]+strings.TrimPrefix(tc.mappers, "\n")+shipped[end:]), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := LoadConfig(path)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("LoadConfig: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("LoadConfig error = %v, want %q", err, tc.wantErr)
			case err != nil:
				return
			}
			f := replyFacts{body: "refused", code: 503, flags: []string{"UF"}, details: "upstream_reset_before_response_started{connection_failure}"}
			if tc.path != "" {
				f.request = &headerMap{}
				f.request.set(":path", tc.path)
			}
			if ct := cfg.LocalReplies.rewrite(&f); f.body != tc.body || f.code != tc.code || ct != tc.ct {
				t.Errorf("rewrite = %d %q (%s), want %d %q (%s)", f.code, f.body, ct, tc.code, tc.body, tc.ct)
			}
			if f := (replyFacts{body: "x", code: 503, flags: []string{"UO"}}); cfg.LocalReplies.rewrite(&f) != "text/plain" || f.body != "x" {
				t.Errorf("a flag no mapper names: %q, want the body as it is", f.body)
			}
		})
	}
}
