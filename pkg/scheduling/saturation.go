package scheduling

// Saturated reports whether every healthy endpoint req may go to is
// saturated by its engine's own figures: a scraped waiting queue at or above
// queue, KV cache use at or above kvCache, or no fresh scrape. So the
// Gateway API Inference Extension's saturation detector judges a pool
// (pkg/epp/saturationdetector: stale figures count as saturated). A pool
// with no such endpoint is not: picking it answers why.
func (p *Pool) Saturated(req *Request, queue, kvCache float64) bool {
	st := p.state.Load()
	sc := p.scopeOf(st, req)
	seen := false
	for _, e := range st.endpoints {
		if !sc.admits(e) || !e.Healthy() {
			continue
		}
		seen = true
		if l, ok := e.Load(); ok && l.Waiting < queue && l.KVUsage < kvCache {
			return false
		}
	}
	return seen
}
