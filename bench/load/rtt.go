package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// RTTResult is the loopback HTTP round trip to the prefill simulator for one
// body: what the P/D flow adds over decode-only, outside extproc.
type RTTResult struct {
	Sim       string // SimPdsim or SimFake
	Name      string // "small" or a body size
	BodyBytes int
	Requests  int
	P50, P99  time.Duration
}

// smallPrefillLeg is the prefill leg of a one-line chat, as extproc sends it.
var smallPrefillLeg = []byte(`{"model":"` + Model + `","messages":[{"role":"user","content":"Hello!"}],"stream":false,"max_tokens":1,` +
	`"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`)

// prefillLeg is the body extproc posts to the prefill engine for a client body.
func prefillLeg(client []byte) ([]byte, error) {
	o, err := body.Parse(client)
	if err != nil {
		return nil, err
	}
	c, err := kv.Build(kv.NIXL)
	if err != nil {
		return nil, err
	}
	return kv.PrefillBody(c, &kv.Handoff{Body: o, Shape: &api.Chat.Shape}).Bytes(), nil
}

// measureRTT posts leg to the prefill simulator n times, one at a time over a
// kept-alive connection, after a short warm-up.
func measureRTT(ctx context.Context, sim, addr, name string, leg []byte, n int) (RTTResult, error) {
	client := &http.Client{Transport: &http.Transport{Proxy: nil, DisableCompression: true}}
	defer client.CloseIdleConnections()
	post := func() error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/v1/chat/completions", bytes.NewReader(leg))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		answer, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK || !bytes.Contains(answer, []byte(`"kv_transfer_params"`)) {
			return fmt.Errorf("prefill answered %s: %.200s", resp.Status, answer)
		}
		return nil
	}
	for range min(n/10+1, 50) {
		if err := post(); err != nil {
			return RTTResult{}, err
		}
	}
	lat := make([]time.Duration, 0, n)
	for range n {
		t0 := time.Now()
		if err := post(); err != nil {
			return RTTResult{}, err
		}
		lat = append(lat, time.Since(t0))
	}
	slices.Sort(lat)
	return RTTResult{Sim: sim, Name: name, BodyBytes: len(leg), Requests: n, P50: Percentile(lat, 0.5), P99: Percentile(lat, 0.99)}, nil
}
