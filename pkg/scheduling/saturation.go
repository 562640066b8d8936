package scheduling

// Lines are where an endpoint counts as saturated (Pool.Saturated): a
// scraped waiting queue at or above Queue, or KV cache use at or above
// KVCache.
type Lines struct{ Queue, KVCache float64 }

// Saturated reports whether every healthy endpoint req may go to is
// saturated by its engine's own figures: a scraped waiting queue or KV cache
// use at or above its line, or no fresh scrape (stale, or the last failed). So the
// Gateway API Inference Extension's saturation detector judges a pool
// (pkg/epp/saturationdetector: stale figures count as saturated). A pool
// with no such endpoint is not: picking it answers why.
func (p *Pool) Saturated(req *Request, lines Lines) bool {
	st := p.state.Load()
	sc := p.scopeOf(st, req)
	seen := false
	for _, e := range st.endpoints {
		if !sc.admits(e) || !e.Healthy() {
			continue
		}
		seen = true
		if l, ok := e.Fresh(); ok && l.Waiting < lines.Queue && l.KVUsage < lines.KVCache {
			return false
		}
	}
	return seen
}
