// Command demo is `make run`: extproc, a prefill and a decode engine simulator
// (vLLM NIXL) and the Envoy emulator on 127.0.0.1:8080, driven by the same
// config/envoy/envoy.yaml users give real Envoy. Ctrl-C stops everything.
package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu"
)

const (
	listen    = "127.0.0.1:8080"
	grpcAddr  = "127.0.0.1:9002"
	adminAddr = "127.0.0.1:9090"
	// The embedded default config (config/extproc.yaml) points at these.
	prefillAddr = "127.0.0.1:8101"
	decodeAddr  = "127.0.0.1:8201"
)

func main() {
	log.SetFlags(0)
	if err := run(); err != nil {
		log.Fatal("demo: ", err)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	procs := []*exec.Cmd{
		command("prefill", "bin/pdsim", "--role", "prefill", "--protocol", "vllm-nixl",
			"--addr", prefillAddr, "--kv-addr", "127.0.0.1:5601"),
		command("decode", "bin/pdsim", "--role", "decode", "--protocol", "vllm-nixl", "--addr", decodeAddr),
		command("extproc", "bin/extproc", "--grpc-addr", grpcAddr, "--admin-addr", adminAddr,
			"--log-format", "console", "-v", "1"),
	}
	defer func() {
		for _, p := range procs {
			if p.Process != nil {
				p.Process.Signal(syscall.SIGTERM)
				p.Wait()
			}
		}
	}()
	for _, p := range procs {
		if err := p.Start(); err != nil {
			return err
		}
	}
	for _, url := range []string{"http://" + prefillAddr + "/health", "http://" + decodeAddr + "/health", "http://" + adminAddr + "/readyz"} {
		if err := waitReady(ctx, url); err != nil {
			return err
		}
	}

	cfg, err := envoyemu.LoadConfig(filepath.Join("config", "envoy", "envoy.yaml"))
	if err != nil {
		return err
	}
	cfg.ListenAddr = listen
	cfg.Logf = prefixed("envoy").Printf
	proxy, err := envoyemu.Start(cfg, grpcAddr)
	if err != nil {
		return err
	}
	defer proxy.Close()

	fmt.Printf(`
pd-extproc demo is up: Envoy emulator on %s -> extproc %s -> prefill %s, decode %s.
Paste this in another terminal (the x-pdsim-kv* response headers show the KV handoff):

  curl -sN http://%s/v1/chat/completions -H 'content-type: application/json' -D - \
    -d '{"model":"pdsim","messages":[{"role":"user","content":"Hello"}],"stream":true,"max_tokens":8}'

Ctrl-C stops everything.
`, listen, grpcAddr, prefillAddr, decodeAddr, listen)
	<-ctx.Done()
	fmt.Println("\nstopping")
	return nil
}

// command runs a binary with its output prefixed by name.
func command(name, bin string, args ...string) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	r, w := io.Pipe()
	cmd.Stdout, cmd.Stderr = w, w
	go func() {
		sc := bufio.NewScanner(r)
		l := prefixed(name)
		for sc.Scan() {
			l.Println(sc.Text())
		}
	}()
	return cmd
}

func prefixed(name string) *log.Logger { return log.New(os.Stdout, fmt.Sprintf("%-8s| ", name), 0) }

// waitReady polls url until it answers 200, for at most 20 s.
func waitReady(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s did not become ready", url)
		case <-tick.C:
		}
	}
}
