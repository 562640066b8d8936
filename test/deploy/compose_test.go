package deploy

import (
	"cmp"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

const composeFile = "config/envoy/docker-compose.yaml"

// composeCommand finds a compose implementation that can run `config` without a Docker engine:
// the Compose v2 plugin (`docker compose`) or the standalone docker-compose.
func composeCommand(t *testing.T) []string {
	t.Helper()
	if docker := testbed.FindTool("docker"); docker != "" {
		if _, err := runTool(t, "", docker, "compose", "version"); err == nil {
			return []string{docker, "compose"}
		}
	}
	if dc := testbed.FindTool("docker-compose"); dc != "" {
		return []string{dc}
	}
	return nil
}

func TestDockerCompose(t *testing.T) {
	cmd := composeCommand(t)
	if cmd == nil {
		t.Skip("neither `docker compose` nor docker-compose found; run `make tools` " +
			"(or `apt-get install docker-compose`) to check " + composeFile)
	}
	root := testbed.MustRepoRoot(t)
	args := append(slices.Clone(cmd[1:]), "-f", filepath.Join(root, filepath.FromSlash(composeFile)), "config")
	out, err := runTool(t, root, cmd[0], args...)
	if err != nil {
		t.Fatalf("%s rejects %s: %v", strings.Join(cmd, " "), composeFile, err)
	}
	var resolved map[string]any
	if err := yaml.Unmarshal(out, &resolved); err != nil {
		t.Fatalf("compose config output: %v", err)
	}
	services, _ := resolved["services"].(map[string]any)
	svc := func(name string) map[string]any {
		s, _ := services[name].(map[string]any)
		return s
	}

	t.Run("services", func(t *testing.T) {
		got := slices.Sorted(maps.Keys(services))
		want := []string{"decode", "envoy", "extproc", "prefill"}
		if !slices.Equal(got, want) {
			t.Errorf("services = %v, want %v", got, want)
		}
	})

	t.Run("envoy runs the shared envoy.yaml on a pinned image", func(t *testing.T) {
		envoy := svc("envoy")
		image := digString(envoy, "image")
		tag, ok := strings.CutPrefix(image, "envoyproxy/envoy:")
		if !ok || tag == "" || tag == "latest" || strings.HasPrefix(tag, "dev") {
			t.Errorf("envoy image = %q, want envoyproxy/envoy with a pinned release tag", image)
		}
		// The e2e emulator reads config/envoy/envoy.yaml; the demo must run that same file.
		want := filepath.Join(root, "config", "envoy", "envoy.yaml")
		if src := bindMounts(envoy)["/etc/envoy/envoy.yaml"]; src != want {
			t.Errorf("envoy mounts %q at /etc/envoy/envoy.yaml, want %q", src, want)
		}
		if !slices.Contains(publishedTargets(envoy), 8080) {
			t.Errorf("envoy does not publish port 8080: %v", envoy["ports"])
		}
		// envoy.yaml binds the admin interface to the container's loopback, where a
		// published port cannot reach it; the stats listener is what the host may scrape.
		if ports := publishedTargets(envoy); slices.Contains(ports, 9901) || !slices.Contains(ports, 9902) {
			t.Errorf("envoy publishes %v; want the stats listener 9902 and not the admin port 9901", ports)
		}
	})

	t.Run("images come from the repository Dockerfile", func(t *testing.T) {
		for _, name := range []string{"extproc", "prefill", "decode"} {
			s := svc(name)
			ctx := digString(s, "build", "context")
			df := digString(s, "build", "dockerfile")
			if ctx != root || (df != "Dockerfile" && df != filepath.Join(root, "Dockerfile")) {
				t.Errorf("%s builds %s with %s, want the repository root and its Dockerfile", name, ctx, df)
			}
		}
		for _, name := range []string{"prefill", "decode"} {
			if ep := fmt.Sprint(dig(svc(name), "entrypoint")); !strings.Contains(ep, "pdsim") {
				t.Errorf("%s entrypoint = %s, want pdsim", name, ep)
			}
		}
	})

	t.Run("extproc pools point at the engine containers by IP", func(t *testing.T) {
		// ORIGINAL_DST accepts only ip:port, so the pool endpoints must be the fixed
		// addresses the engines get on the compose network, on the port pdsim listens on.
		// The config's directory is mounted, so that an edit that replaces the file reaches
		// the watching pd-extproc.
		cfgPath := flagValue(toStrings(dig(svc("extproc"), "command")), "--config")
		src := hostPath(bindMounts(svc("extproc")), cfgPath)
		if want := filepath.Join(root, "config", "envoy", "extproc-compose.yaml"); src != want {
			t.Fatalf("--config=%s is %q on the host, want %s through a directory mount", cfgPath, src, want)
		}
		if _, fileMounted := bindMounts(svc("extproc"))[cfgPath]; fileMounted {
			t.Errorf("%s is mounted as a single file: a replaced file would never reach the container", cfgPath)
		}
		docs := yamlDocuments(t, src)
		subnet := composeSubnet(t, resolved)
		for _, pool := range []string{"prefill", "decode"} {
			eps := toStrings(dig(docs[0], "pools", pool, "endpoints"))
			want := netip.AddrPortFrom(serviceIP(t, svc(pool), subnet), listenPort(t, svc(pool)))
			if !slices.Equal(eps, []string{want.String()}) {
				t.Errorf("pools.%s.endpoints = %v, want [%s] (the %s container)", pool, eps, want, pool)
			}
		}
		for _, name := range []string{"envoy", "extproc"} {
			serviceIP(t, svc(name), subnet)
		}
	})

	t.Run("mTLS certificates from make certs on both sides", func(t *testing.T) {
		// Every certificate file Envoy's transport socket and pd-extproc's --tls-* flags name
		// lies in a mount of the directory hack/certs.sh writes; the SDS files that name
		// Envoy's are the shipped ones.
		certs := filepath.Join(root, "config", "envoy", "certs")
		envoyMounts := bindMounts(svc("envoy"))
		sdsFiles, certFiles := extProcTLSFiles(t, filepath.Join(root, "config", "envoy", "envoy.yaml"), envoyMounts)
		for _, f := range certFiles {
			if src := hostPath(envoyMounts, f); !strings.HasPrefix(src, filepath.Join(certs, "envoy")+"/") {
				t.Errorf("envoy reads %s from %q on the host, want a file of %s/envoy", f, src, certs)
			}
		}
		for _, f := range sdsFiles {
			if src := hostPath(envoyMounts, f); filepath.Dir(src) != filepath.Join(root, "config", "envoy", "sds") {
				t.Errorf("envoy reads the SDS file %s from %q on the host, want one of config/envoy/sds", f, src)
			}
		}
		cmd := toStrings(dig(svc("extproc"), "command"))
		for _, flag := range []string{"--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"} {
			f := flagValue(cmd, flag)
			if src := hostPath(bindMounts(svc("extproc")), f); f == "" || !strings.HasPrefix(src, filepath.Join(certs, "extproc")+"/") {
				t.Errorf("extproc %s=%s is %q on the host, want a file of %s/extproc", flag, f, src, certs)
			}
		}
		if got := flagValue(cmd, "--tls-client-allowed-sans"); got != testbed.ClientSAN {
			t.Errorf("extproc --tls-client-allowed-sans=%q, want %s, the SAN of Envoy's certificate", got, testbed.ClientSAN)
		}
	})

	// Outside Kubernetes only Envoy's health checks take a stopping pd-extproc out of the
	// rotation: it must serve new streams, not ready, until they have.
	t.Run("extproc's shutdown delay outlasts envoy.yaml's health checks", func(t *testing.T) {
		hc := extProcCluster(t, filepath.Join(root, "config", "envoy", "envoy.yaml")).GetHealthChecks()
		if len(hc) != 1 {
			t.Fatalf("the ext_proc cluster has %d health checks, want one", len(hc))
		}
		interval, timeout := hc[0].GetInterval().AsDuration(), hc[0].GetTimeout().AsDuration()
		delay, err := time.ParseDuration(flagValue(toStrings(dig(svc("extproc"), "command")), "--shutdown-delay"))
		// A NOT_SERVING answer ejects at once; the next check is an interval away, and one
		// lost to its timeout costs one interval more.
		if want := 2*interval + timeout; err != nil || delay < want {
			t.Errorf("extproc --shutdown-delay = %v (%v), want at least %v: two checks %v apart and one's %v timeout",
				delay, err, want, interval, timeout)
		}
	})

	// Docker kills a container its stop grace after SIGTERM (10 s unless set): extproc's
	// drain, the delay then the streams' grace and 5 s to flush traces, must fit in it.
	t.Run("the stop grace covers extproc's drain", func(t *testing.T) {
		cmd := toStrings(dig(svc("extproc"), "command"))
		delay, errDelay := time.ParseDuration(flagValue(cmd, "--shutdown-delay"))
		grace, errGrace := time.ParseDuration(flagValue(cmd, "--shutdown-grace"))
		if errDelay != nil || errGrace != nil {
			t.Fatalf("extproc must set --shutdown-delay and --shutdown-grace for the stop grace to cover: %v, %v", errDelay, errGrace)
		}
		stop, err := time.ParseDuration(cmp.Or(digString(svc("extproc"), "stop_grace_period"), "10s"))
		if want := delay + grace + 5*time.Second; err != nil || stop < want {
			t.Errorf("extproc stop_grace_period = %v (%v), want at least %v: --shutdown-delay %v, --shutdown-grace %v and 5 s to flush",
				stop, err, want, delay, grace)
		}
	})

	t.Run("envoy.yaml reaches extproc by its compose name", func(t *testing.T) {
		host, port := extProcUpstream(t, filepath.Join(root, "config", "envoy", "envoy.yaml"))
		if _, ok := services[host]; !ok || port != 9002 {
			t.Errorf("envoy.yaml sends ext_proc to %s:%d, want the compose service extproc:9002", host, port)
		}
	})
}

// extProcUpstream returns the address of the first endpoint of the cluster ext_proc uses.
func extProcUpstream(t *testing.T, path string) (string, uint32) {
	t.Helper()
	c := extProcCluster(t, path)
	for _, le := range c.GetLoadAssignment().GetEndpoints() {
		for _, lb := range le.GetLbEndpoints() {
			sa := lb.GetEndpoint().GetAddress().GetSocketAddress()
			return sa.GetAddress(), sa.GetPortValue()
		}
	}
	t.Fatalf("%s: no ext_proc cluster endpoint found", path)
	return "", 0
}

// extProcCluster returns the cluster the first ext_proc filter of a bootstrap streams to.
func extProcCluster(t *testing.T, path string) *clusterv3.Cluster {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Skipf("%v (reported by TestEnvoyConfigsAreValid)", err)
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		t.Fatal(err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	var r report
	m := modelFromBootstrap(&b, &r)
	for _, u := range m.hcms {
		for _, ep := range extProcFilters(u.hcm) {
			if c := m.clusters[ep.config.GetGrpcService().GetEnvoyGrpc().GetClusterName()]; c != nil {
				return c
			}
		}
	}
	t.Fatalf("%s: no ext_proc cluster found", path)
	return nil
}

// composeSubnet is the fixed subnet of the compose network the services share.
func composeSubnet(t *testing.T, resolved map[string]any) netip.Prefix {
	t.Helper()
	cfgs, _ := dig(resolved, "networks", "pd", "ipam", "config").([]any)
	if len(cfgs) != 1 {
		t.Fatalf("network pd: want one fixed ipam subnet, got %v", cfgs)
	}
	p, err := netip.ParsePrefix(digString(cfgs[0], "subnet"))
	if err != nil {
		t.Fatalf("network pd subnet: %v", err)
	}
	return p
}

// serviceIP is a service's fixed address on the pd network, which must lie in its subnet.
func serviceIP(t *testing.T, svc map[string]any, subnet netip.Prefix) netip.Addr {
	t.Helper()
	a, err := netip.ParseAddr(digString(svc, "networks", "pd", "ipv4_address"))
	if err != nil || !subnet.Contains(a) {
		t.Fatalf("service networks = %v: want a fixed ipv4_address in %s", svc["networks"], subnet)
	}
	return a
}

// listenPort reads pdsim's --addr=host:port flag.
func listenPort(t *testing.T, svc map[string]any) uint16 {
	t.Helper()
	for _, arg := range toStrings(svc["command"]) {
		if addr, ok := strings.CutPrefix(arg, "--addr="); ok {
			_, p, _ := strings.Cut(addr, ":")
			n, err := strconv.ParseUint(p, 10, 16)
			if err == nil {
				return uint16(n)
			}
		}
	}
	t.Fatalf("command %v has no --addr=host:port", svc["command"])
	return 0
}

// bindMounts maps container paths to host paths; compose v1 prints "src:dst[:mode]" strings,
// compose v2 prints long-syntax objects.
func bindMounts(svc map[string]any) map[string]string {
	out := map[string]string{}
	vols, _ := svc["volumes"].([]any)
	for _, v := range vols {
		switch x := v.(type) {
		case string:
			parts := strings.Split(x, ":")
			if len(parts) >= 2 {
				out[parts[1]] = parts[0]
			}
		case map[string]any:
			out[digString(x, "target")] = digString(x, "source")
		}
	}
	return out
}

// publishedTargets lists container ports published to the host, in either compose syntax.
func publishedTargets(svc map[string]any) []int {
	var out []int
	ports, _ := svc["ports"].([]any)
	for _, p := range ports {
		switch x := p.(type) {
		case string:
			spec, _, _ := strings.Cut(x, "/")
			parts := strings.Split(spec, ":")
			if n, err := strconv.Atoi(parts[len(parts)-1]); err == nil && len(parts) > 1 {
				out = append(out, n)
			}
		case map[string]any:
			if n, ok := x["target"].(float64); ok && x["published"] != nil {
				out = append(out, int(n))
			}
		}
	}
	return out
}

func toStrings(v any) []string {
	list, _ := v.([]any)
	out := make([]string, 0, len(list))
	for _, e := range list {
		out = append(out, fmt.Sprint(e))
	}
	return out
}

// flagValue is the value of --name=value in args ("" when absent).
func flagValue(args []string, name string) string {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v
		}
	}
	return ""
}

// hostPath is where a container path comes from on the host through the bind mounts (the
// longest mount that contains it), or "".
func hostPath(mounts map[string]string, containerPath string) string {
	best := ""
	for target := range mounts {
		if (containerPath == target || strings.HasPrefix(containerPath, strings.TrimSuffix(target, "/")+"/")) && len(target) > len(best) {
			best = target
		}
	}
	if best == "" {
		return ""
	}
	return filepath.Join(mounts[best], strings.TrimPrefix(containerPath, best))
}

// extProcTLSFiles lists the files the ext_proc cluster's TLS transport socket of a bootstrap
// reads, as the emulator reads them: the SDS files, and the certificate files (those the SDS
// files name are read through mounts, container path to host path).
func extProcTLSFiles(t *testing.T, path string, mounts map[string]string) (sds, certs []string) {
	t.Helper()
	cfg, err := envoyemu.LoadConfig(path)
	if err != nil {
		t.Fatalf("the emulator refuses the bootstrap: %v", err)
	}
	tls := cfg.Clusters[cfg.ExtProcCluster].TLS
	if tls == nil {
		t.Fatalf("%s: the ext_proc cluster has no TLS", path)
	}
	sds, certs, err = tls.Files(mounts)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return sds, certs
}
