package main

import (
	"context"
	"io"
	"reflect"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/pdsim"
)

func TestParseFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want func(c pdsim.Config) bool
	}{
		{"defaults make a vLLM NIXL decode on :8000", nil, func(c pdsim.Config) bool {
			return c.Role == "decode" && c.Protocol == "vllm-nixl" && c.Model == "pdsim" && c.Addr == ":8000" &&
				c.KVAddr == ":5600" && c.BootstrapAddr == ":8998" && c.OutputTokens == 16 && c.FailStatus == 0 &&
				c.PrefixCacheBlocks == 8192 && c.KVEvents == pdsim.KVEvents{Encoding: "map", BufferSteps: 10_000} && c.MaxRecords == 10_000 &&
				c.MaxModelLen == 32768
		}},
		{"every flag", []string{"--role", "prefill", "--protocol", "sglang", "--model", "m", "--addr", "127.0.0.1:1",
			"--kv-addr", "127.0.0.1:2", "--bootstrap-addr", "127.0.0.1:3", "--advertise-host", "10.0.0.1", "--shared-dir", "/x",
			"--ttft", "1s", "--tpot", "2ms", "--kv-transfer", "3ms", "--output-tokens", "4", "--handshake-timeout", "5s",
			"--fail-status", "503", "--fail-every", "2", "--delay", "6ms", "--drop-connections",
			"--prefix-cache-blocks", "9", "--kv-events-endpoint", "tcp://*:5557", "--kv-events-replay-endpoint", "tcp://*:5558", "--kv-events-topic", "t",
			"--kv-events-encoding", "array", "--kv-events-int-hashes", "--kv-events-buffer-steps", "7", "--kv-events-drop-every", "8",
			"--lora-modules", "a,b=/adapters/b", "--lora-modules", "c", "--max-records", "11", "--max-model-len", "12", "--stop-one-token"}, func(c pdsim.Config) bool {
			return reflect.DeepEqual(c, pdsim.Config{Role: "prefill", Protocol: "sglang", Model: "m", Addr: "127.0.0.1:1", KVAddr: "127.0.0.1:2",
				BootstrapAddr: "127.0.0.1:3", AdvertiseHost: "10.0.0.1", SharedDir: "/x", TTFT: time.Second, TPOT: 2 * time.Millisecond,
				KVTransfer: 3 * time.Millisecond, OutputTokens: 4, HandshakeTimeout: 5 * time.Second, FailStatus: 503, FailEvery: 2,
				Delay: 6 * time.Millisecond, DropConnections: true, PrefixCacheBlocks: 9, DropKVEventsEvery: 8,
				KVEvents: pdsim.KVEvents{Endpoint: "tcp://*:5557", ReplayEndpoint: "tcp://*:5558", Topic: "t", Encoding: "array",
					IntHashes: true, BufferSteps: 7}, LoRA: []string{"a", "b", "c"}, MaxRecords: 11, MaxModelLen: 12, StopOneToken: true})
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseFlags(tt.args, io.Discard)
			if err != nil || !tt.want(c) {
				t.Errorf("%+v, %v", c, err)
			}
		})
	}
	for _, bad := range [][]string{{"--nope"}, {"stray"}, {"--ttft", "soon"}} {
		if _, err := parseFlags(bad, io.Discard); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestRunStopsWhenContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	args := []string{"--role", "prefill", "--addr", "127.0.0.1:0", "--kv-addr", "127.0.0.1:0"}
	if err := run(ctx, args, io.Discard); err != nil {
		t.Fatal(err)
	}
	if err := run(ctx, []string{"--role", "neither"}, io.Discard); err == nil {
		t.Error("bad role accepted")
	}
}
