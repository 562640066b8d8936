package pdsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// vLLM's MooncakeConnector, as vllm/distributed/kv_transfer/kv_connector/v1/mooncake
// has it: the router sends both legs at once with one transfer_id. The
// prefill engine computes the prompt and, if its answer was cut by its
// length, keeps the blocks under that id; it hands nothing back. The decode
// engine asks the bootstrap server the decode leg names (GET /query) for the
// engine the leg names, then pulls the blocks from that engine's worker,
// which waits for a prefill not finished yet. pdsim's worker is the kv
// listener, the block store's side channel waiting up to the handshake
// timeout, as the connector's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT bounds it.

// mooncakeRank is one data-parallel rank in a bootstrap server's /query.
type mooncakeRank struct {
	EngineID   string                       `json:"engine_id"`
	WorkerAddr map[string]map[string]string `json:"worker_addr"` // tp rank → pp rank → tcp://host:port
}

type mooncakePrefill struct {
	s     *Server
	store *blockStore // by transfer_id
}

// bootstrap serves the prefill engine's GET /query: one rank, this engine.
func (p *mooncakePrefill) bootstrap() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /query", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]mooncakeRank{"0": {
			EngineID: p.s.engineID, WorkerAddr: map[string]map[string]string{"0": {"0": "tcp://" + p.s.KVAddr()}},
		}})
	})
	return mux
}

func (p *mooncakePrefill) firstToken(ctx context.Context, req *request) (kvResult, error) {
	kv := kvParams(req)
	if flag(kv, "do_remote_prefill") {
		return kvResult{}, errors.New("do_remote_prefill on a prefill engine: vLLM's Mooncake scheduler asserts it is no kv_producer")
	}
	if err := p.s.compute(ctx, req); err != nil {
		return kvResult{}, err
	}
	if !flag(kv, "do_remote_decode") {
		return kvResult{outcome: kvNone}, nil
	}
	var id string
	json.Unmarshal(kv["transfer_id"], &id)
	if id == "" {
		p.s.log.Warn("Missing transfer_id in kv_transfer_params from router!", "request_id", req.id)
		return kvResult{outcome: kvNone}, nil
	}
	// request_finished keeps the blocks of a length-capped answer only, not
	// of one that stopped, as a one-token answer may (stoptoken.go)
	// (MooncakeConnectorScheduler, mooncake_connector.py @ 00f4240e).
	if _, finish := req.outputTokens(p.s.cfg.OutputTokens); finish != "length" || p.s.stopsAtOnce(req) {
		return kvResult{outcome: kvNone}, nil
	}
	p.store.issue(id, p.s.engineID, req)
	if p.s.losesKV() {
		p.store.release(id)
	}
	return kvResult{outcome: kvIssued}, nil
}

type mooncakeDecode struct{ s *Server }

func (d *mooncakeDecode) firstToken(ctx context.Context, req *request) (kvResult, error) {
	kv := kvParams(req)
	if !flag(kv, "do_remote_prefill") {
		return kvResult{outcome: kvNone}, d.s.compute(ctx, req)
	}
	var want struct {
		EngineID   string `json:"remote_engine_id"`
		Bootstrap  string `json:"remote_bootstrap_addr"`
		TransferID string `json:"transfer_id"`
	}
	json.Unmarshal(req.kv, &want)
	for _, f := range []struct{ key, value string }{
		{"remote_engine_id", want.EngineID}, {"remote_bootstrap_addr", want.Bootstrap}, {"transfer_id", want.TransferID},
	} {
		if f.value == "" {
			// vLLM has already put the request to wait for remote KV, then
			// finds the params invalid and never pulls: it waits for ever.
			return kvResult{}, fmt.Errorf("kv_transfer_params without %s: vLLM's decode request would wait for this KV for ever", f.key)
		}
	}
	var ranks map[string]mooncakeRank
	if err := d.s.callPeer(ctx, http.MethodGet, want.Bootstrap+"/query", nil, &ranks); err != nil {
		return kvResult{}, fmt.Errorf("querying the bootstrap server %s: %w", want.Bootstrap, err)
	}
	var worker string
	for _, r := range ranks {
		if r.EngineID == want.EngineID {
			worker = strings.TrimPrefix(r.WorkerAddr["0"]["0"], "tcp://")
		}
	}
	if worker == "" {
		return kvResult{}, fmt.Errorf("remote engine_id %s not found from bootstrap server %s", want.EngineID, want.Bootstrap)
	}
	blocksURL := "http://" + worker + "/kv/" + url.PathEscape(want.TransferID)
	var held kvBlocks
	if err := d.s.callPeer(ctx, http.MethodGet, blocksURL, nil, &held); err != nil {
		return kvResult{}, fmt.Errorf("pulling KV of %s from %s: %w", want.TransferID, worker, err)
	}
	switch {
	case held.EngineID != want.EngineID:
		return kvResult{}, fmt.Errorf("KV of %s belongs to engine %s, not remote_engine_id %s", want.TransferID, held.EngineID, want.EngineID)
	case held.PromptHash != req.promptHash:
		return kvResult{}, fmt.Errorf("KV of %s was computed for a different prompt", want.TransferID)
	}
	if err := d.s.pulled(ctx, blocksURL); err != nil {
		return kvResult{}, err
	}
	return kvResult{outcome: kvHit, source: worker, requestID: held.RequestID}, nil
}
