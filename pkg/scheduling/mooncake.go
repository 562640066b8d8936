package scheduling

import (
	"context"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"time"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// vLLM's MooncakeConnector pairs the legs through the prefill engine's
// bootstrap server (VLLM_MOONCAKE_BOOTSTRAP_PORT, 8998 by default), a plain
// HTTP server beside the engine: GET /query lists the engine's
// data-parallel ranks, each with the engine id the decode leg must name
// (vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_utils.py).
// An engine's id changes when it restarts, so a kv-mooncake prefill pool
// reads them again as it reads SGLang's server info: every minute, and
// after the endpoint was ejected.
const maxEngineIDs = 1 << 20 // a rank's entry lists its workers' addresses

// ReadsEngineIDs says whether the pool asks its engines' Mooncake bootstrap
// servers for their engine ids: a kv-mooncake prefill pool.
func (p *Pool) ReadsEngineIDs() bool { return p.probe.rendezvous == kv.MooncakeEngineIDs }

// bootstrapAddr is e's bootstrap server, host:port.
func (p *Pool) bootstrapAddr(e *Endpoint) string {
	host, _, err := net.SplitHostPort(e.Addr)
	if err != nil {
		host = e.Addr
	}
	return net.JoinHostPort(host, strconv.Itoa(p.BootstrapPort(e)))
}

// EngineID is, for a kv-mooncake prefill endpoint, one of its engine's
// data-parallel ranks and that rank's engine id, chosen by seed (a random
// number per request) among the ranks its bootstrap server listed, and how
// many it listed: 0 when none, or it was never read.
func (e *Endpoint) EngineID(seed uint64) (rank, id string, ranks int) {
	info := e.info.Load()
	if info == nil || len(info.ranks) == 0 {
		return "", "", 0
	}
	rank = info.ranks[seed%uint64(len(info.ranks))]
	return rank, info.engineIDs[rank], len(info.ranks)
}

// Ranks says how many data-parallel ranks the endpoint's bootstrap server
// listed.
func (e *Endpoint) Ranks() int {
	if info := e.info.Load(); info != nil {
		return len(info.engineIDs)
	}
	return 0
}

// fetchEngineIDs asks the bootstrap server at addr for its engine ids.
func fetchEngineIDs(ctx context.Context, pr probe, addr string, timeout time.Duration) serverInfo {
	url := "http://" + addr + "/query"
	var ranks map[string]struct {
		EngineID string `json:"engine_id"`
	}
	// Before every worker registered, newer servers answer 503.
	if _, err := pr.getJSON(ctx, url, timeout, maxEngineIDs, &ranks); err != nil {
		return serverInfo{err: err.Error()}
	}
	ids := map[string]string{}
	for rank, entry := range ranks {
		if n, err := strconv.Atoi(rank); err != nil || n < 0 || entry.EngineID == "" {
			return serverInfo{err: fmt.Sprintf("%s: rank %q names no engine_id", url, rank)}
		}
		ids[rank] = entry.EngineID
	}
	if len(ids) == 0 {
		return serverInfo{err: url + " lists no rank"}
	}
	return engineInfo(ids)
}

// engineInfo is what a bootstrap server's ids say: ids, and their ranks
// sorted, which EngineID draws from.
func engineInfo(ids map[string]string) serverInfo {
	return serverInfo{engineIDs: ids, ranks: slices.Sorted(maps.Keys(ids))}
}

// logEngineIDs says what changed: the ids learned or changed, a read that
// began to fail.
func logEngineIDs(log logr.Logger, old, info *serverInfo) {
	switch {
	case info.err != "" && info.err != old.err && len(info.engineIDs) == 0:
		log.Info("cannot read the engine's Mooncake bootstrap server: no P/D request goes to it until it answers", "error", info.err)
	case info.err != "" && info.err != old.err:
		log.Info("cannot read the engine's Mooncake bootstrap server: its engine ids are those read before", "error", info.err)
	case info.err == "" && !maps.Equal(info.engineIDs, old.engineIDs):
		log.Info("the engine's Mooncake engine ids, from its bootstrap server", "engine_ids", info.engineIDs)
	}
}
