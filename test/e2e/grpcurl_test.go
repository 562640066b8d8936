package e2e

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// grpcurl runs the reference gRPC client (installed by `make tools`) with stdin.
func grpcurl(t *testing.T, stdin string, args ...string) string {
	t.Helper()
	bin := testbed.FindTool("grpcurl")
	if bin == "" {
		t.Skip("grpcurl not on PATH or in " + strings.Join(testbed.ToolDirs(), ", ") + ": run `make tools` (make test does) to install it")
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("grpcurl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func TestGrpcurlSeesTheServiceAsEnvoyWould(t *testing.T) {
	// The pools ask the decode endpoint for its models: port 1 of loopback refuses.
	x := startExtproc(t, testbed.ExtprocConfig{Config: `{connector: kv-nixl, pools: {decode: {endpoints: ["127.0.0.1:1"]}}}`})

	t.Run("list shows ext_proc, health and reflection", func(t *testing.T) {
		out := grpcurl(t, "", "-plaintext", x.GRPCAddr, "list")
		for _, svc := range []string{"envoy.service.ext_proc.v3.ExternalProcessor", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} {
			if !strings.Contains(out, svc) {
				t.Errorf("grpcurl list lacks %s:\n%s", svc, out)
			}
		}
	})
	t.Run("health check is SERVING", func(t *testing.T) {
		for _, svc := range []string{"", "envoy.service.ext_proc.v3.ExternalProcessor"} {
			out := grpcurl(t, "", "-plaintext", "-d", fmt.Sprintf(`{"service":%q}`, svc), x.GRPCAddr, "grpc.health.v1.Health/Check")
			if !strings.Contains(out, `"SERVING"`) {
				t.Errorf("health of %q: %s", svc, out)
			}
		}
	})
	t.Run("one FULL_DUPLEX exchange returns the destination header", func(t *testing.T) {
		b64 := base64.StdEncoding.EncodeToString
		body := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
		msgs := fmt.Sprintf(`{"protocolConfig":{"requestBodyMode":"FULL_DUPLEX_STREAMED"},
 "requestHeaders":{"headers":{"headers":[{"key":":method","rawValue":%q},{"key":":path","rawValue":%q},{"key":"content-type","rawValue":%q}]}}}
{"requestBody":{"body":%q,"endOfStream":true}}`, b64([]byte("POST")), b64([]byte("/v1/chat/completions")), b64([]byte("application/json")), b64([]byte(body)))
		out := grpcurl(t, msgs, "-plaintext", "-d", "@", x.GRPCAddr, "envoy.service.ext_proc.v3.ExternalProcessor/Process")
		dec := json.NewDecoder(strings.NewReader(out))
		var first struct {
			RequestHeaders struct {
				Response struct {
					HeaderMutation struct {
						SetHeaders []struct {
							Header struct{ Key, RawValue string }
						}
					}
				}
			}
		}
		if err := dec.Decode(&first); err != nil {
			t.Fatalf("decoding the first reply: %v\n%s", err, out)
		}
		var dest string
		for _, h := range first.RequestHeaders.Response.HeaderMutation.SetHeaders {
			if h.Header.Key == "x-gateway-destination-endpoint" {
				v, _ := base64.StdEncoding.DecodeString(h.Header.RawValue)
				dest = string(v)
			}
		}
		if dest != "127.0.0.1:1" {
			t.Errorf("destination = %q, want 127.0.0.1:1:\n%s", dest, out)
		}
	})
}
