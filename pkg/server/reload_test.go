package server

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// A reload of the watched file applies the pools and names, in its log line,
// each changed key that keeps its running value until a restart.
func TestReloadLogNamesRestartOnlyKeys(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "extproc.yaml")
	first := "connector: kv-nixl\npools: {decode: {endpoints: [\"" + decodeEP + "\"]}}\n"
	if err := os.WriteFile(path, []byte(first), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &logLines{}
	r := start(t, first, Options{ConfigPath: path}, funcr.NewJSON(logs.add, funcr.Options{}))
	next := "connector: kv-nixl\npools: {decode: {endpoints: [\"" + refusedEP + "\"]}}\nlimits: {max_concurrent_streams: 7}\n"
	if err := os.WriteFile(path, []byte(next), 0o600); err != nil {
		t.Fatal(err)
	}
	line := waitLogLine(t, logs, "config reloaded")
	// prefill.max_background follows limits.max_concurrent_streams, its default.
	if keys := fmt.Sprint(line["restartPending"]); keys != "[limits.max_concurrent_streams prefill.max_background]" {
		t.Errorf("restartPending = %s, want [limits.max_concurrent_streams prefill.max_background]: %v", keys, line)
	}
	if msg := line["msg"].(string); !strings.Contains(msg, "only on restart") {
		t.Errorf("the reload line does not say keys wait for a restart: %q", msg)
	}
	metrics := r.scrape(t)
	if got := metrics[`pd_extproc_config_reloads_total{outcome="applied"}`]; got != 1 {
		t.Errorf("config_reloads_total{applied} = %v, want 1", got)
	}
	if got := metrics["pd_extproc_config_restart_pending"]; got != 2 {
		t.Errorf("config_restart_pending = %v, want 2 (the keys waiting for a restart)", got)
	}
	if err := os.WriteFile(path, []byte("connector: kv-nixl\npools: {decode: {endpoints: 7}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	waitLogLine(t, logs, "config change rejected")
	if got := r.scrape(t)[`pd_extproc_config_reloads_total{outcome="rejected"}`]; got != 1 {
		t.Errorf("config_reloads_total{rejected} = %v after a file that does not parse, want 1", got)
	}
	// The pool itself is live: the new decode endpoint is the one reported.
	deadline := time.Now().Add(10 * time.Second)
	for r.scrape(t)[series("pd_extproc_endpoint_healthy", "endpoint", refusedEP, "pool", "decode")] != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the reloaded decode endpoint never appeared in /metrics")
		}
		time.Sleep(20 * time.Millisecond) // the metrics read the pools as they are: poll, bounded
	}
}

// With no decode engine configured (the embedded default names none) the
// server starts, is not ready, and says what to set.
func TestNoDecodePoolServesNotReadyAndSaysWhatToSet(t *testing.T) {
	logs := &logLines{}
	r := start(t, "connector: kv-nixl\n", Options{}, funcr.NewJSON(logs.add, funcr.Options{}))
	if code, body := r.get(t, "/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz = %d %q, want 503", code, body)
	}
	line := waitLogLine(t, logs, "no decode engine is configured")
	msg := line["msg"].(string)
	for _, want := range []string{"pools.decode.endpoints", "pools.decode.dns", "pools.decode.kubernetes", "--config"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the line does not name %s: %q", want, msg)
		}
	}
	if line["config"] != "the embedded default config (no --config given)" {
		t.Errorf("config = %v, want the embedded default named", line["config"])
	}
}

// Under kv-sglang, whose decode engines serve only prefill/decode pairs, a
// config that names no prefill engine leaves the replica not ready: the
// start, and a reload to such a config, say what to set. Under the other
// connectors requests go decode-only, and nothing is said.
func TestNoPrefillPoolUnderKVSGLangSaysWhatToSet(t *testing.T) {
	decode := `decode: {endpoints: ["` + decodeEP + `"]}`
	const prefill = `prefill: {endpoints: ["` + refusedEP + `"]}, `
	const noPrefill = "no prefill engine is configured"
	tests := []struct {
		name, connector, pools string
		reload                 string // pools of the file a reload reads; "": none
		want                   bool
	}{
		{"kv-sglang without a prefill engine", "kv-sglang", "{" + decode + "}", "", true},
		{"kv-sglang with one", "kv-sglang", "{" + prefill + decode + "}", "", false},
		{"kv-nixl without one: requests go decode-only", "kv-nixl", "{" + decode + "}", "", false},
		{"kv-sglang, reloaded without it", "kv-sglang", "{" + prefill + decode + "}", "{" + decode + "}", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "extproc.yaml")
			file := func(pools string) string { return "connector: " + tt.connector + "\npools: " + pools + "\n" }
			if err := os.WriteFile(path, []byte(file(tt.pools)), 0o600); err != nil {
				t.Fatal(err)
			}
			logs := &logLines{}
			r := start(t, file(tt.pools), Options{ConfigPath: path}, funcr.NewJSON(logs.add, funcr.Options{}))
			said := slices.ContainsFunc(logs.all(t), func(l map[string]any) bool { // New logs it, before it returns
				msg, _ := l["msg"].(string)
				return strings.HasPrefix(msg, noPrefill)
			})
			if said != (tt.want && tt.reload == "") {
				t.Fatalf("at start, a line saying no prefill engine is configured: %v:\n%s", said, logs.raw())
			}
			if !tt.want {
				return
			}
			if tt.reload != "" {
				if err := os.WriteFile(path, []byte(file(tt.reload)), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			line := waitLogLine(t, logs, noPrefill)
			msg := line["msg"].(string)
			for _, want := range []string{"kv-sglang", "not ready", "pools.prefill.endpoints", "pools.prefill.dns", "pools.prefill.kubernetes"} {
				if !strings.Contains(msg, want) {
					t.Errorf("the line does not name %s: %q", want, msg)
				}
			}
			if line["config"] != path {
				t.Errorf("config = %v, want %s", line["config"], path)
			}
			if code, body := r.get(t, "/readyz"); tt.reload == "" && code != http.StatusServiceUnavailable {
				t.Errorf("/readyz = %d %q, want 503", code, body) // a reload's, the next poll tells
			}
		})
	}
}

// waitLogLine waits, bounded, for a line whose message starts with prefix.
func waitLogLine(t *testing.T, logs *logLines, prefix string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		for _, l := range logs.all(t) {
			if msg, _ := l["msg"].(string); strings.HasPrefix(msg, prefix) {
				return l
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log line %q:\n%s", prefix, logs.raw())
		}
		time.Sleep(10 * time.Millisecond) // the watch runs on its own goroutine: poll, bounded
	}
}

// The README's Configuration section names the keys a reload applies and
// those that wait for a restart; both lists must be the ones above.
func TestREADMENamesTheReloadableKeys(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(strings.Fields(string(readme)), " ")
	between := func(from, to string) []string {
		_, rest, ok := strings.Cut(text, from)
		part, _, ok2 := strings.Cut(rest, to)
		if !ok || !ok2 {
			t.Fatalf("README has no %q ... %q", from, to)
		}
		var keys []string
		for i, s := range strings.Split(part, "`") {
			if i%2 == 1 {
				keys = append(keys, s)
			}
		}
		return keys
	}
	expand := func(key string) []string {
		key = strings.TrimSuffix(key, ".*")
		switch {
		case strings.HasPrefix(key, "."):
			return []string{"pools.prefill" + key, "pools.decode" + key}
		case strings.HasPrefix(key, "pools.<pool>."):
			rest := strings.TrimPrefix(key, "pools.<pool>")
			return []string{"pools.prefill" + rest, "pools.decode" + rest}
		}
		return []string{key}
	}
	var live []string
	for _, k := range between("These keys apply without a restart", "Every other key") {
		live = append(live, expand(k)...)
	}
	if !slices.Equal(slices.Sorted(slices.Values(live)), slices.Sorted(slices.Values(config.LiveKeys))) {
		t.Errorf("README's live keys %q, want %q", live, config.LiveKeys)
	}
	restart := between("takes effect only on restart:", "A reload")
	for _, k := range restart {
		for _, key := range expand(k) {
			if slices.ContainsFunc(config.LiveKeys, func(k string) bool { return key == k || strings.HasPrefix(key, k+".") }) {
				t.Errorf("README calls %s restart-only, but a reload applies it", key)
			}
		}
	}
	for _, top := range []string{"connector", "prefill.*", "limits.*", "envoy.*", "tracing.*", "routes.passthrough",
		"routes.pair_builtin_tools", "routes.messages_decode_only", "routes.responses_decode_only", "response.*"} {
		if !slices.Contains(restart, top) {
			t.Errorf("README's restart-only list lacks %s", top)
		}
	}
}

// Where requests may be held for room, a pool scraped less often than every
// 250 ms is named at start: the hold lets requests go a scrape at a time.
func TestSlowScrapesAreNamedWhereRequestsMayBeHeld(t *testing.T) {
	tests := []struct {
		name, admission, interval string
		named                     bool
	}{
		{"held, scraped every second", "{objectives: {batch: -1}}", "1s", true},
		{"held, scraped every 250 ms", "{objectives: {batch: -1}}", "250ms", false},
		{"refused at once", "{objectives: {batch: -1}, hold: 0s}", "1s", false},
		{"nothing to shed", "{objectives: {chat: 1}}", "1s", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logs := &logLines{}
			start(t, fmt.Sprintf(`connector: kv-nixl
pools:
  prefill: {endpoints: ["127.0.0.1:1"], metrics: {interval: %[2]s}}
  decode: {endpoints: ["127.0.0.1:2"], metrics: {interval: %[2]s}}
admission: %[1]s
`, tt.admission, tt.interval), Options{}, funcr.NewJSON(logs.add, funcr.Options{}))
			var keys []string
			for _, l := range logs.all(t) {
				if msg, _ := l["msg"].(string); strings.HasPrefix(msg, "requests may be held for room") {
					keys = append(keys, fmt.Sprint(l["key"]))
				}
			}
			want := []string(nil)
			if tt.named {
				want = []string{"pools.prefill.metrics.interval", "pools.decode.metrics.interval"}
			}
			if !slices.Equal(keys, want) {
				t.Errorf("named %v, want %v", keys, want)
			}
		})
	}
}

// Keys that do nothing without the key that turns them on are named, each
// with that key, in one line at start and at each reload that keeps some.
func TestIgnoredKeysAreNamedAtStartAndReload(t *testing.T) {
	const msg = "these keys do nothing without the key that turns them on, and are ignored"
	steps := []struct{ pools, want string }{ // the first starts the server, the others reload it
		{`{decode: {endpoints: ["` + decodeEP + `"], dns_interval: 5s}}`, "[pools.decode.dns_interval (needs pools.decode.dns)]"},
		{`{prefill: {endpoints: ["` + refusedEP + `"], metrics: {timeout: 1s}}, decode: {endpoints: ["` + decodeEP + `"], health: {check_path: /ready}}}`,
			"[pools.prefill.metrics.timeout (needs pools.prefill.metrics.interval) pools.decode.health.check_path (needs pools.decode.health.check_interval)]"},
	}
	path := filepath.Join(t.TempDir(), "extproc.yaml")
	logs := &logLines{}
	for i, step := range steps {
		file := "connector: kv-nixl\npools: " + step.pools + "\n"
		if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			start(t, file, Options{ConfigPath: path}, funcr.NewJSON(logs.add, funcr.Options{}))
		}
		var named []string
		for deadline := time.Now().Add(10 * time.Second); len(named) <= i && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond) // the watch runs on its own goroutine: poll, bounded
			named = nil
			for _, l := range logs.all(t) {
				if l["msg"] == msg {
					named = append(named, fmt.Sprint(l["ignored"]))
				}
			}
		}
		if len(named) != i+1 || named[i] != step.want {
			t.Fatalf("step %d: lines naming ignored keys: %q; want the last to name %s:\n%s", i, named, step.want, logs.raw())
		}
	}
}

// An override of Envoy's message timer shorter than the prefill phase is
// named at start: in BUFFERED processing Envoy would answer 504 first.
func TestShortOverrideIsNamedAtStart(t *testing.T) {
	tests := []struct {
		name, envoy, want string // want: the line's message; "" for none
	}{
		{"below prefill.timeout", "{override_message_timeout: 10s}",
			"envoy.override_message_timeout 10s is below prefill.timeout 30s: in BUFFERED processing Envoy answers 504 before the prefill leg may end; " +
				"raise it (and Envoy's max_message_timeout), or lower prefill.timeout"},
		{"the default", "{}", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logs := &logLines{}
			start(t, "connector: kv-nixl\nenvoy: "+tt.envoy+"\npools: {decode: {endpoints: [\""+decodeEP+"\"]}}\n", Options{}, funcr.NewJSON(logs.add, funcr.Options{}))
			var got []string
			for _, l := range logs.all(t) {
				if msg, _ := l["msg"].(string); strings.HasPrefix(msg, "envoy.override_message_timeout") {
					got = append(got, msg)
				}
			}
			if want := slices.DeleteFunc([]string{tt.want}, func(s string) bool { return s == "" }); !slices.Equal(got, want) {
				t.Errorf("lines %q, want %q", got, want)
			}
		})
	}
}

// A reload that moves a pool to Kubernetes discovery, which starts only
// with the process, keeps the pool's endpoints and DNS name until the
// restart, and counts them as waiting for it: the pool was empty from the
// reload on, and every request got 503.
func TestReloadToKubernetesKeepsThePoolUntilTheRestart(t *testing.T) {
	tests := []struct {
		name, decode, want string // want: the endpoint routed to, before and after the reload
		pending            []string
	}{
		{"from static endpoints", `{endpoints: ["127.0.0.1:2"]}`, "127.0.0.1:2",
			[]string{"pools.decode.endpoints", "pools.decode.kubernetes"}},
		{"from a DNS name", `{dns: "localhost:3", dns_interval: 1h}`, "127.0.0.1:3",
			[]string{"pools.decode.dns", "pools.decode.dns_interval", "pools.decode.kubernetes"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "extproc.yaml")
			first := "connector: kv-nixl\npools: {decode: " + tt.decode + "}\n"
			if err := os.WriteFile(path, []byte(first), 0o600); err != nil {
				t.Fatal(err)
			}
			logs := &logLines{}
			r := start(t, first, Options{ConfigPath: path}, funcr.NewJSON(logs.add, funcr.Options{}))
			route := func() string {
				replies := r.exchange(t, post(chatPath, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)...)
				return destination(replies[0])
			}
			deadline := time.Now().Add(10 * time.Second)
			for route() != tt.want { // a DNS pool has its endpoint once the name answers
				if time.Now().After(deadline) {
					t.Fatalf("never routed to %s before the reload", tt.want)
				}
				time.Sleep(20 * time.Millisecond) // the lookup runs on its own goroutine: poll, bounded
			}
			next := "connector: kv-nixl\npools: {decode: {kubernetes: {selector: role=decode, port: 8000}}}\n"
			if err := os.WriteFile(path, []byte(next), 0o600); err != nil {
				t.Fatal(err)
			}
			line := waitLogLine(t, logs, "config reloaded")
			if got, want := fmt.Sprint(line["restartPending"]), fmt.Sprint(tt.pending); got != want {
				t.Errorf("restartPending = %s, want %s", got, want)
			}
			if got := r.scrape(t)["pd_extproc_config_restart_pending"]; got != float64(len(tt.pending)) {
				t.Errorf("config_restart_pending = %v, want %d", got, len(tt.pending))
			}
			if got := route(); got != tt.want {
				t.Errorf("after the reload routed to %q, want %s", got, tt.want)
			}
		})
	}
}

// reloadedLines starts the server on first, reloads next, then first again,
// and returns the lines logged before that second reload began: those of
// the start and of next's reload, whose warnings are written before the
// watch reads the file again.
func reloadedLines(t *testing.T, first, next string, opts Options) []map[string]any {
	t.Helper()
	opts.ConfigPath = filepath.Join(t.TempDir(), "extproc.yaml")
	if err := os.WriteFile(opts.ConfigPath, []byte(first), 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &logLines{}
	start(t, first, opts, funcr.NewJSON(logs.add, funcr.Options{}))
	var lines []map[string]any
	for _, file := range []string{next, first} {
		if err := os.WriteFile(opts.ConfigPath, []byte(file), 0o600); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(10 * time.Second); ; {
			lines = nil
			reloads := 0
			for _, l := range logs.all(t) {
				if msg, _ := l["msg"].(string); strings.HasPrefix(msg, "config reloaded") {
					reloads++
				}
				if reloads == 2 {
					break
				}
				lines = append(lines, l)
			}
			if reloads == slices.Index([]string{next, first}, file)+1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no reload of %q:\n%s", file, logs.raw())
			}
			time.Sleep(10 * time.Millisecond) // the watch runs on its own goroutine: poll, bounded
		}
	}
	return lines
}

// A reload is warned of what the keys in force do: a pool whose dropped
// kubernetes key still finds its engines until the restart is still
// scraped too seldom where requests may be held.
func TestSlowScrapesAreNamedAtAReloadDroppingKubernetes(t *testing.T) {
	kubeconfig := refusingKubeconfig(t)
	const admission = "admission: {objectives: {batch: -1}}\n"
	first := "connector: kv-nixl\npools: {decode: {kubernetes: {namespace: llm, selector: role=decode, port: 8000}, metrics: {interval: 1s}}}\n" + admission
	next := "connector: kv-nixl\npools: {decode: {metrics: {interval: 1s}}}\n" + admission
	var named int
	for _, l := range reloadedLines(t, first, next, Options{Kubeconfig: kubeconfig}) {
		msg, _ := l["msg"].(string)
		if strings.HasPrefix(msg, "requests may be held for room") {
			named++
		}
		if strings.HasPrefix(msg, "no decode engine is configured") {
			t.Errorf("logged %q: the pool's discovery runs until the restart", msg)
		}
	}
	if named != 2 {
		t.Errorf("pools.decode.metrics.interval named %d times, want 2: at start and at the reload", named)
	}
}

// The override of Envoy's message timer is checked, at a reload, as it
// runs: envoy.* and prefill.timeout keep their values until a restart,
// while admission.hold applies at once.
func TestShortOverrideAtAReloadComparesTheValuesInForce(t *testing.T) {
	const decode = "pools: {decode: {endpoints: [\"127.0.0.1:2\"], metrics: {interval: 100ms}}}\n"
	tests := []struct{ name, first, next, want string }{
		{"an override the file shortens", "envoy: {override_message_timeout: 40s}", "envoy: {override_message_timeout: 10s}", ""},
		{"a hold added under the running prefill.timeout", "envoy: {override_message_timeout: 35s}",
			"prefill: {timeout: 5s}\nenvoy: {override_message_timeout: 35s}\nadmission: {objectives: {batch: -1}, hold: 10s}",
			"envoy.override_message_timeout 35s is below prefill.timeout 30s + admission.hold 10s: in BUFFERED processing Envoy answers 504 " +
				"before the prefill leg may end; raise it (and Envoy's max_message_timeout), or lower prefill.timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			for _, l := range reloadedLines(t, "connector: kv-nixl\n"+decode+tt.first+"\n", "connector: kv-nixl\n"+decode+tt.next+"\n", Options{}) {
				if msg, _ := l["msg"].(string); strings.HasPrefix(msg, "envoy.override_message_timeout") {
					got = append(got, msg)
				}
			}
			if want := slices.DeleteFunc([]string{tt.want}, func(s string) bool { return s == "" }); !slices.Equal(got, want) {
				t.Errorf("lines %q, want %q", got, want)
			}
		})
	}
}

// refusingKubeconfig is a kubeconfig whose API server refuses connections:
// Kubernetes discovery starts, and finds nothing.
func refusingKubeconfig(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
users: [{name: u, user: {}}]
contexts: [{name: x, context: {cluster: c, user: u, namespace: llm}}]
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// A reload that moves a pool between DNS and Kubernetes discovery keeps the
// pool's dns and dns_interval as they run until the restart: the warnings
// judge those, so a dns_interval the running lookups still follow is not
// named as ignored, and one no running lookup follows is.
func TestReloadNamesDNSIntervalAsItRuns(t *testing.T) {
	const (
		kube = "kubernetes: {namespace: llm, selector: role=decode, port: 8000}"
		dns  = `dns: "localhost:3"`
	)
	tests := []struct {
		name, first, next string // the decode pool's keys
		pending, ignored  string // the reload's restartPending and ignored keys; "": no such line
	}{
		{"DNS to Kubernetes, dns_interval kept", dns + ", dns_interval: 1h", kube + ", dns_interval: 1h",
			"[pools.decode.dns pools.decode.kubernetes]", ""},
		{"DNS to Kubernetes, dns_interval changed", dns + ", dns_interval: 1h", kube + ", dns_interval: 30m",
			"[pools.decode.dns pools.decode.dns_interval pools.decode.kubernetes]", ""},
		{"Kubernetes to DNS, dns_interval kept", kube + ", dns_interval: 1h", dns + ", dns_interval: 1h",
			"[pools.decode.dns pools.decode.kubernetes]", "[pools.decode.dns_interval (needs pools.decode.dns)]"},
		{"dns_interval changed alone", dns + ", dns_interval: 1h", dns + ", dns_interval: 30m", "", ""},
		{"dns_interval removed alone", dns + ", dns_interval: 1h", dns, "", ""},
		{"dns_interval changed alone under Kubernetes", kube + ", dns_interval: 1h", kube + ", dns_interval: 30m",
			"", "[pools.decode.dns_interval (needs pools.decode.dns)]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := func(decode string) string { return "connector: kv-nixl\npools: {decode: {" + decode + "}}\n" }
			lines := reloadedLines(t, file(tt.first), file(tt.next), Options{Kubeconfig: refusingKubeconfig(t)})
			lines = lines[slices.IndexFunc(lines, func(l map[string]any) bool { return strings.HasPrefix(fmt.Sprint(l["msg"]), "config reloaded") }):]
			var pending, ignored string
			for _, l := range lines {
				if l["restartPending"] != nil {
					pending = fmt.Sprint(l["restartPending"])
				}
				if l["ignored"] != nil {
					ignored = fmt.Sprint(l["ignored"])
				}
			}
			if pending != tt.pending || ignored != tt.ignored {
				t.Errorf("restartPending %q, ignored %q; want %q, %q", pending, ignored, tt.pending, tt.ignored)
			}
		})
	}
}
