package pdsim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
)

// nixlParams is the kv_transfer_params object current vLLM's NIXL pull
// scheduler returns from a prefill, keys in its order.
type nixlParams struct {
	DoRemotePrefill        bool      `json:"do_remote_prefill"`
	DoRemoteDecode         bool      `json:"do_remote_decode"`
	RemoteBlockIDs         [][]int64 `json:"remote_block_ids"`
	RemoteEngineID         string    `json:"remote_engine_id"`
	RemoteRequestID        string    `json:"remote_request_id"`
	RemoteHost             string    `json:"remote_host"`
	RemotePort             int       `json:"remote_port"`
	TPSize                 int       `json:"tp_size"`
	DCPSize                int       `json:"dcp_size"`
	PPSize                 int       `json:"pp_size"`
	RemoteNumTokens        int       `json:"remote_num_tokens"`
	RemoteBlocksExpiryTime *float64  `json:"remote_blocks_expiry_time"`
	TransferMode           string    `json:"transfer_mode"`
}

type nixlPrefill struct {
	s     *Server
	store *blockStore
}

func (p *nixlPrefill) firstToken(ctx context.Context, req *request) (kvResult, error) {
	if err := p.s.compute(ctx, req); err != nil {
		return kvResult{}, err
	}
	// A streamed answer has no kv_transfer_params field in vLLM, so the blocks
	// could never be claimed: treat it as an ordinary request. Nor does
	// NixlConnector's single-file release hand out KV for an answer that
	// stopped rather than hit its length (request_finished,
	// nixl_connector.py @ 002a1057): it frees the blocks.
	if !flag(kvParams(req), "do_remote_decode") || req.stream || p.s.stopsAtOnce(req) {
		return kvResult{outcome: kvNone}, nil
	}
	host, portText, _ := net.SplitHostPort(p.s.KVAddr())
	port, _ := strconv.Atoi(portText)
	blk := p.store.issue(req.internalID, p.s.engineID, req)
	if p.s.losesKV() {
		p.store.release(req.internalID)
	}
	params, err := json.Marshal(nixlParams{
		DoRemotePrefill: true, RemoteBlockIDs: blk.BlockIDs, RemoteEngineID: p.s.engineID,
		RemoteRequestID: req.internalID, RemoteHost: host, RemotePort: port,
		TPSize: 1, DCPSize: 1, PPSize: 1, RemoteNumTokens: req.promptTokens, TransferMode: "pull",
	})
	return kvResult{outcome: kvIssued, params: params}, err
}

type nixlDecode struct{ s *Server }

func (d *nixlDecode) firstToken(ctx context.Context, req *request) (kvResult, error) {
	kv := kvParams(req)
	if !flag(kv, "do_remote_prefill") {
		return kvResult{outcome: kvNone}, d.s.compute(ctx, req)
	}
	var blockIDs any
	if raw, ok := present(kv, "remote_block_ids"); ok {
		decodeNumbers(raw, &blockIDs)
	}
	if list, _ := blockIDs.([]any); len(list) == 0 {
		return kvResult{}, errors.New("do_remote_prefill without remote_block_ids: vLLM's scheduler asserts num_external_tokens == 0")
	}
	for _, key := range []string{"remote_engine_id", "remote_request_id", "remote_host", "remote_port"} {
		raw, ok := kv[key]
		switch {
		case !ok:
			// vLLM's scheduler has already put the request to wait for remote KV
			// (get_num_new_matched_tokens goes by do_remote_prefill alone), and
			// update_state_after_alloc then schedules no pull ("Got invalid
			// KVTransferParams"): the request waits for ever. A hang would stall
			// a test to its timeout; a 500 that says so fails it at once.
			return kvResult{}, fmt.Errorf("kv_transfer_params without %s: vLLM's decode request would wait for this KV for ever (WAITING_FOR_REMOTE_KVS)", key)
		case isNull(raw):
			// vLLM checks that the keys are there, not what they hold: it goes
			// on to the handshake with None for an address, which fails, and
			// under its default kv_load_failure_policy the request with it.
			return kvResult{}, fmt.Errorf("kv_transfer_params.%s is null: the handshake with the prefill engine fails", key)
		}
	}
	var want struct {
		EngineID  string `json:"remote_engine_id"`
		RequestID string `json:"remote_request_id"`
		Host      string `json:"remote_host"`
		Port      int    `json:"remote_port"`
	}
	if err := json.Unmarshal(req.kv, &want); err != nil {
		return kvResult{}, fmt.Errorf("kv_transfer_params: %w", err)
	}
	source := net.JoinHostPort(want.Host, strconv.Itoa(want.Port))
	blocksURL := "http://" + source + "/kv/" + url.PathEscape(want.RequestID)

	var held kvBlocks
	if err := d.s.callPeer(ctx, http.MethodGet, blocksURL, nil, &held); err != nil {
		return kvResult{}, fmt.Errorf("reading KV blocks of %s from %s: %w", want.RequestID, source, err)
	}
	gotIDs, _ := json.Marshal(held.BlockIDs)
	wantIDs, _ := json.Marshal(blockIDs)
	switch {
	case held.EngineID != want.EngineID:
		return kvResult{}, fmt.Errorf("KV blocks of %s belong to engine %s, not remote_engine_id %s", want.RequestID, held.EngineID, want.EngineID)
	case !bytes.Equal(gotIDs, wantIDs):
		return kvResult{}, fmt.Errorf("remote_block_ids %s do not match the blocks %s of %s", wantIDs, gotIDs, want.RequestID)
	case held.PromptHash != req.promptHash:
		return kvResult{}, fmt.Errorf("KV blocks of %s were computed for a different prompt", want.RequestID)
	}
	if err := d.s.pulled(ctx, blocksURL); err != nil {
		return kvResult{}, err
	}
	res := kvResult{outcome: kvHit, source: source, requestID: held.RequestID}
	if flag(kv, "do_remote_decode") && !req.stream {
		// vLLM's connector reads do_remote_decode on whatever engine finishes
		// the request: a decode leg that kept it true holds its blocks for a
		// lease, and its answer carries kv_transfer_params to the client.
		res.params, _ = json.Marshal(nixlParams{DoRemotePrefill: true, RemoteEngineID: d.s.engineID,
			RemoteRequestID: req.internalID, TPSize: 1, DCPSize: 1, PPSize: 1, RemoteNumTokens: req.promptTokens, TransferMode: "pull"})
	}
	return res, nil
}

// kvParams returns the request's kv_transfer_params object, nil when absent.
func kvParams(req *request) map[string]json.RawMessage {
	var m map[string]json.RawMessage
	json.Unmarshal(req.kv, &m)
	return m
}

// flag is true only for a JSON true, as the connector's params.get(key) is truthy.
func flag(m map[string]json.RawMessage, key string) bool {
	var v bool
	return json.Unmarshal(m[key], &v) == nil && v
}
