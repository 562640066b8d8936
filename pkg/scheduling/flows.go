package scheduling

import (
	"crypto/sha256"
	"encoding/hex"
	"maps"
	"slices"
)

// This file holds the flows a Hold takes turns between, and what it
// remembers of those it served.

// flow is what takes turns within a priority: a client's fairness id
// (x-gateway-inference-fairness-id), "" for those that send none.
type flow struct {
	id       string
	priority int
}

// Bounds on what a hold remembers of the flows it served, whatever fairness
// ids clients send: at most maxFlows flows with nothing held (a flood of
// distinct ids while a flow never served waits, which keeps forget from
// dropping any, would grow it without end), each id at most maxFlowIDBytes
// (a longer one is kept as its digest).
const (
	maxFlows       = 4096
	maxFlowIDBytes = 128
)

// flowOf is the flow of a request of that fairness id and priority.
func flowOf(fairness string, priority int) flow {
	if len(fairness) > maxFlowIDBytes {
		sum := sha256.Sum256([]byte(fairness))
		fairness = "sha256:" + hex.EncodeToString(sum[:])
	}
	return flow{fairness, priority}
}

// forget drops what it remembers of flows with nothing held that were
// served less lately than every flow with requests held: one that comes
// back takes its turn as a new one (never served), which it would take
// anyway. A flow served since keeps its place behind the others: were it
// forgotten, one that empties the hold at each release and sends again
// before the next would take every place.
func (h *Hold) forget() {
	if len(h.served) == 0 {
		return
	}
	waiting, least := make(map[flow]bool, len(h.held)), h.serial+1
	for _, x := range h.held {
		waiting[x.flow] = true
		least = min(least, h.served[x.flow])
	}
	maps.DeleteFunc(h.served, func(f flow, n uint64) bool { return !waiting[f] && n < least })
	if len(h.served)-len(waiting) > maxFlows {
		h.forgetOldest(waiting)
	}
}

// forgetOldest drops the flows with nothing held that were served least
// lately, keeping half of maxFlows of them: at most one release in
// maxFlows/2 pays for the sort. One dropped that comes back takes its turn
// as a new one, ahead of the flows it would have gone behind: only a flow
// that sent nothing while maxFlows/2 others were served is dropped.
func (h *Hold) forgetOldest(waiting map[flow]bool) {
	serials := make([]uint64, 0, len(h.served))
	for f, n := range h.served {
		if !waiting[f] {
			serials = append(serials, n)
		}
	}
	if len(serials) <= maxFlows {
		return
	}
	slices.Sort(serials)
	keep := serials[len(serials)-maxFlows/2] // serials are distinct: each release takes a new one
	maps.DeleteFunc(h.served, func(f flow, n uint64) bool { return !waiting[f] && n < keep })
}
