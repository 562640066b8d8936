package server

import (
	"fmt"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/discovery"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// check is one condition of readiness, as /readyz?verbose lists it.
type check struct {
	name   string
	ok     bool
	detail string
}

// checks reads every readiness condition now: the health of each pool
// requests need, then each discovered pool's sync state and API server
// reachability. An unreachable API server is reported but passes: the pool
// serves on with the endpoints it last had.
func (r *readiness) checks() []check {
	states := r.endpoints()
	var out []check
	for _, pool := range r.pools {
		out = append(out, poolCheck(pool, states))
	}
	if r.discovery == nil {
		return out
	}
	for _, st := range r.discovery() {
		out = append(out, discoveryCheck(st))
	}
	return out
}

// poolCheck passes while pool has a healthy endpoint, or one that only
// failed requests keep out: the pool still routes among those (Envoy's
// panic routing), and every replica sees the same engines, so turning them
// all unready would only take the service away, and bring it back late. An
// endpoint the active checks have not judged yet does not count: at start,
// before the first round ends, its engine may refuse every connection.
func poolCheck(pool string, states []metrics.EndpointState) check {
	healthy, ejected, awaiting, total := 0, 0, 0, 0
	for _, e := range states {
		if e.Pool == pool {
			total++
			switch {
			case e.AwaitsCheck: // taken healthy, but no check has passed yet
				awaiting++
			case e.Healthy:
				healthy++
			case !e.CheckedDown:
				ejected++
			}
		}
	}
	c := check{name: pool + " pool", ok: healthy+ejected > 0, detail: fmt.Sprintf("%d of %d endpoints healthy", healthy, total)}
	switch {
	case healthy == 0 && ejected > 0:
		c.detail = fmt.Sprintf("every endpoint failed requests; routing among the %d no active check finds down (%s)", ejected, c.detail)
	case healthy == 0 && awaiting > 0:
		c.detail = fmt.Sprintf("no %s endpoint has passed a health check yet (%d awaiting their first; %s)", pool, awaiting, c.detail)
	case healthy == 0:
		c.detail = fmt.Sprintf("no healthy %s endpoint (%s)", pool, c.detail)
	}
	return c
}

func discoveryCheck(st discovery.PoolStatus) check {
	c := check{name: "kubernetes " + st.Pool, ok: st.Ready()}
	what := fmt.Sprintf("pods in namespace %q", st.Namespace)
	if st.InferencePool != "" {
		what = fmt.Sprintf("InferencePool %s/%s", st.Namespace, st.InferencePool)
	}
	switch {
	case st.Refused != nil && st.Served:
		c.detail = fmt.Sprintf("%s: refused since it was followed, serving the last %d endpoints known: %v", what, st.Endpoints, st.Refused)
		return c
	case st.Refused != nil:
		c.detail = fmt.Sprintf("%s: refused: %v", what, st.Refused)
		return c
	case !st.Synced:
		c.detail = what + ": not synced yet"
	case !st.PoolFound:
		c.detail = fmt.Sprintf("%s: synced; the InferencePool does not exist, so no endpoints", what)
	default:
		c.detail = fmt.Sprintf("%s: synced, %d endpoints", what, st.Endpoints)
	}
	switch {
	case st.Synced && st.Reachable:
		c.detail += "; API server reachable"
	case st.Synced:
		c.detail += "; API server unreachable, serving the last endpoints known"
	}
	if st.LastError != nil {
		c.detail += fmt.Sprintf("; last error %s ago: %v", time.Since(st.LastErrorAt).Round(time.Second), st.LastError)
	}
	return c
}
