package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"time"
)

// The driver re-executes itself as this child (-child NAME): a process of its
// own, so its CPU is measured apart from the client's.
const (
	// childPrefill is a zero-latency vLLM NIXL prefill engine that answers
	// every request with the same kv_transfer_params, for runs where pdsim's
	// own cost (it parses every prompt and keeps every request) is unwanted.
	childPrefill = "fake-prefill"
)

func runChild(ctx context.Context, name string, args []string) error {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:0", "HTTP listen address")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if name != childPrefill {
		return fmt.Errorf("unknown -child %q", name)
	}
	return serveFakePrefill(ctx, *addr)
}

// fakePrefillCached is the prompt tokens the fake prefill found cached.
const fakePrefillCached = "384"

// fakePrefillAnswer is a vLLM NIXL prefill's non-streamed answer, from an
// engine run with --enable-prompt-tokens-details.
const fakePrefillAnswer = `{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"` + Model + `",` +
	`"choices":[{"index":0,"message":{"role":"assistant","content":"The"},"finish_reason":"length"}],` +
	`"usage":{"prompt_tokens":1000,"completion_tokens":1,"total_tokens":1001,"prompt_tokens_details":{"cached_tokens":` + fakePrefillCached + `}},` +
	`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3,4,5,6,7,8]],` +
	`"remote_engine_id":"bench-engine","remote_request_id":"chatcmpl-bench","remote_host":"127.0.0.1","remote_port":5600,` +
	`"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":1000,"remote_blocks_expiry_time":null,"transfer_mode":"pull"}}`

// serveFakePrefill serves until ctx ends (SIGTERM or an interrupt).
func serveFakePrefill(ctx context.Context, addr string) error {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, fakePrefillAnswer)
	})
	s := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	context.AfterFunc(ctx, func() { s.Close() })
	if err := s.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
