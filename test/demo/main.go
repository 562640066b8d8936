// Command demo is `make run`: extproc, a prefill and a decode engine simulator
// (vLLM NIXL) and the Envoy emulator on 127.0.0.1:8080, driven by the same
// config/envoy/envoy.yaml users give real Envoy. It runs make's bin/extproc
// and bin/pdsim, each a process of its own with its output prefixed by its
// name. Ctrl-C stops everything.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

const (
	listen      = "127.0.0.1:8080"
	grpcAddr    = "127.0.0.1:9002"
	adminAddr   = "127.0.0.1:9090"
	prefillAddr = "127.0.0.1:8101"
	decodeAddr  = "127.0.0.1:8201"
)

// extprocConfig is the demo's own config: the embedded default names no
// engine, so a binary run without --config routes nothing.
const extprocConfig = `connector: kv-nixl
pools:
  prefill: {endpoints: ["` + prefillAddr + `"]}
  decode: {endpoints: ["` + decodeAddr + `"]}
`

func main() {
	log.SetFlags(0)
	if err := run(); err != nil {
		log.Fatal("demo: ", err)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var cleanups testbed.Cleanups
	defer cleanups.Close()

	pdsim, err := testbed.RepoPath("bin/pdsim")
	if err != nil {
		return err
	}
	for _, sim := range []struct {
		name, addr string
		args       []string
	}{
		{"prefill", prefillAddr, []string{"--role", "prefill", "--kv-addr", "127.0.0.1:5601"}},
		{"decode", decodeAddr, []string{"--role", "decode"}},
	} {
		if _, err := testbed.StartProcess(ctx, &cleanups, testbed.ProcessConfig{
			Name: sim.name, Bin: pdsim, Args: append(sim.args, "--protocol", "vllm-nixl", "--addr", sim.addr),
			Log: lines(sim.name), Ready: testbed.HTTPOK("http://" + sim.addr + "/health"),
		}); err != nil {
			return err
		}
	}
	extproc, err := testbed.RepoPath("bin/extproc")
	if err != nil {
		return err
	}
	// Envoy and extproc speak mTLS, as in every shipped setup, with certificates made now.
	mtls, err := testbed.NewMTLS(&cleanups, testbed.MTLSConfig{})
	if err != nil {
		return err
	}
	if _, err := testbed.StartExtproc(ctx, &cleanups, testbed.ExtprocConfig{
		Bin: extproc, GRPCAddr: grpcAddr, AdminAddr: adminAddr, Config: extprocConfig, MTLS: mtls,
		Args: []string{"--log-format", "console", "-v", "1"}, Log: lines("extproc"),
	}); err != nil {
		return err
	}
	if _, err := testbed.StartEnvoy(&cleanups, testbed.EnvoyConfigs["full_duplex"], grpcAddr, func(cfg *envoyemu.Config) {
		cfg.ListenAddr = listen
		cfg.Logf = prefixed("envoy").Printf
		mtls.Envoy(cfg)
	}); err != nil {
		return err
	}

	fmt.Printf(`
pd-extproc demo is up: Envoy emulator on %s -> (mTLS) extproc %s -> prefill %s, decode %s.
Paste this in another terminal (the x-pdsim-kv* response headers show the KV handoff):

  curl -sN http://%s/v1/chat/completions -H 'content-type: application/json' -D - \
    -d '{"model":"pdsim","messages":[{"role":"user","content":"Hello"}],"stream":true,"max_tokens":8}'

Ctrl-C stops everything.
`, listen, grpcAddr, prefillAddr, decodeAddr, listen)
	<-ctx.Done()
	fmt.Println("\nstopping")
	return nil
}

func prefixed(name string) *log.Logger { return log.New(os.Stdout, fmt.Sprintf("%-8s| ", name), 0) }

// lines prints a process's output prefixed by its name.
func lines(name string) testbed.LineFunc {
	l := prefixed(name)
	return func(line string) { l.Println(line) }
}
