package server

import (
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// poolStates reads the pools' endpoints as they are at each call.
func poolStates(pools ...*scheduling.Pool) func() []metrics.EndpointState {
	return func() []metrics.EndpointState {
		var out []metrics.EndpointState
		for _, p := range pools {
			for _, e := range p.Endpoints() {
				st := metrics.EndpointState{Pool: p.Name(), Endpoint: e.Addr, InFlight: e.InFlight(), Healthy: e.InRotation(), CheckedDown: e.CheckedDown(), AwaitsCheck: p.AwaitsCheck(e), Ejections: e.Ejections(),
					CacheTrusted: e.CacheTrusted(), EngineRanks: -1, Models: e.Models(), ScrapeFailures: e.ScrapeFailures()}
				if p.ReadsBootstrapPorts() {
					st.BootstrapPort = p.BootstrapPort(e)
				}
				if p.ReadsEngineIDs() {
					st.EngineRanks = e.Ranks()
				}
				if l, ok := e.Fresh(); ok {
					st.Scraped, st.Waiting, st.KVUsage = true, l.Waiting, l.KVUsage
				}
				out = append(out, st)
			}
		}
		return out
	}
}

// kvEventStates reads the KV event views of the pools that follow their
// engines' events, as they are at each call.
func kvEventStates(pools ...*scheduling.Pool) func() []metrics.KVEventsState {
	return func() []metrics.KVEventsState {
		var out []metrics.KVEventsState
		for _, p := range pools {
			ev, ok := p.Events()
			if !ok {
				continue
			}
			c := ev.Counts
			out = append(out, metrics.KVEventsState{Pool: p.Name(),
				Batches: c.Batches.Load(), Gaps: c.Gaps.Load(), Replayed: c.Replayed.Load(), ReplayFailed: c.ReplayFailed.Load(),
				Restarts: c.Restarts.Load(), UnknownTopics: c.UnknownTopics.Load(), Undecodable: c.Undecodable.Load(),
				TooLarge: c.TooLarge.Load(), Orphans: c.Orphans.Load(), Skipped: c.Skipped.Load(), UnknownEvents: c.UnknownEvents.Load(),
				Publishers: ev.Index.Publishers, Stale: ev.Index.Stale, Blocks: ev.Index.Blocks})
		}
		return out
	}
}
