package envoyemu

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
)

// matchRoute picks the first matching route: prefix against the whole
// :path, path against :path without its query (Envoy RouteMatch).
func matchRoute(routes []Route, path string) *Route {
	noQuery, _, _ := strings.Cut(path, "?")
	for i := range routes {
		r := &routes[i]
		if (r.Path != "" && r.Path == noQuery) || (r.Path == "" && strings.HasPrefix(path, r.Prefix)) {
			return r
		}
	}
	return nil
}

// router is the request direction's sink: the router filter. It picks the
// host when the headers arrive (§2.11) and streams the body upstream over
// HTTP/1.1, chunked when there is no Content-Length (§2.6 "Upstream framing").
type router struct {
	x       *exchange
	route   *Route // cached at decodeHeaders time (§3.6)
	reroute bool   // clear_route_cache honoured
	cancel  context.CancelFunc
	body    *streamBody // the upstream request's
	timer   loopTimer   // the route timeout (§5)
	wait    loopTimer   // the backoff before a retry
	// retrying releases the retry under way in the cluster's max_retries.
	retrying func()
	// attempts are the hosts to try and what a retry sends again.
	attempts attempts
}

// cancelUpstream abandons the upstream request, if one started.
func (rt *router) cancelUpstream() {
	if rt.cancel != nil {
		rt.cancel()
	}
}

// stop ends everything the router started, at the exchange's end.
func (rt *router) stop(err error) {
	rt.timer.stop()
	rt.wait.stop()
	rt.releaseRetry()
	if rt.body != nil {
		rt.body.abort(err)
	}
	rt.cancelUpstream()
}

func (rt *router) headers(h *headerMap, end bool) {
	x := rt.x
	if rt.reroute {
		// clear_route_cache: re-match with the mutated :path (§3.6).
		p, _ := h.get(":path")
		rt.route = matchRoute(x.cfg.Routes, p)
		rt.reroute = false
	}
	route := rt.route
	if route == nil {
		x.localReply(http.StatusNotFound, "NR", "", "route_not_found")
		return
	}
	md := x.md.routing
	if md == nil {
		md = x.md.stream
	}
	hosts := chooseHosts(x.cfg.Clusters[route.Cluster].OriginalDst, h, md, x.cfg.GatewayFallbacks)
	if len(hosts) == 0 {
		x.localReply(http.StatusServiceUnavailable, "UH", "no healthy upstream", "no_healthy_upstream")
		return
	}
	rt.attempts = attempts{hosts: hosts, headers: h, noBody: end}
	if rt.send(hosts[0]) && end {
		rt.startRouteTimer(route.Timeout)
	}
}

// send starts an attempt on addr; false when the request cannot be built.
func (rt *router) send(addr string) bool {
	x, a := rt.x, &rt.attempts
	a.made, a.at = a.made+1, addr
	x.p.recordUpstream(addr)
	req, err := rt.buildRequest(addr, a.headers, a.noBody, rt.route)
	if err != nil {
		x.localReply(http.StatusBadRequest, "", "", "invalid_upstream_request: "+err.Error())
		return false
	}
	x.startUpstream(req, rt.cluster(), rt.route.Retry != nil)
	return true
}

// cluster is the circuit-breaker accounting of the route's cluster.
func (rt *router) cluster() *resources {
	return rt.x.p.routed.get(rt.x.cfg.Clusters[rt.route.Cluster])
}

func (rt *router) data(b []byte, end bool) {
	if rt.keep(b, end, nil); rt.x.finished {
		return
	}
	if len(b) > 0 {
		rt.body.push(b)
	}
	if end {
		rt.body.end(nil)
		rt.startRouteTimer(rt.route.Timeout)
	}
}

func (rt *router) trailers(t *headerMap) {
	rt.keep(nil, true, t)
	rt.body.end(t)
	rt.startRouteTimer(rt.route.Timeout)
}

func (rt *router) buildRequest(addr string, h *headerMap, end bool, route *Route) (*http.Request, error) {
	x := rt.x
	method, _ := h.get(":method")
	path, _ := h.get(":path")
	authority, _ := h.get(":authority")
	u, err := url.Parse("http://" + addr + path)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(x.ctx)
	rt.cancel = cancel
	var body io.ReadCloser = http.NoBody
	contentLength := int64(0)
	if !end {
		rt.body = newStreamBody()
		body = rt.body
		contentLength = -1
		if v, ok := h.get("content-length"); ok {
			if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
				contentLength = n
			}
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), body)
	if err != nil {
		return nil, err
	}
	req.Host = authority
	req.Header = http.Header{}
	h.toHTTPHeader(req.Header)
	req.Header.Del("Content-Length") // framing comes from ContentLength
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header["User-Agent"] = nil // Go would add its own; Envoy does not
	}
	if route.Timeout > 0 && !x.cfg.SuppressEnvoyHeaders {
		req.Header.Set("X-Envoy-Expected-Rq-Timeout-Ms", strconv.FormatInt(route.Timeout.Milliseconds(), 10))
	}
	req.ContentLength = contentLength
	if contentLength < 0 {
		// Filled from the transport's own goroutine when the body ends.
		req.Trailer = http.Header{}
		rt.body.trailerDst = req.Trailer
	}
	return req, nil
}

// startUpstream runs the upstream exchange in the background, once the
// cluster's circuit breakers admit it (§12), and reports headers, body chunks
// and trailers as events; with a retry policy, it first asks the event loop
// whether its failure or its status is retried.
func (x *exchange) startUpstream(req *http.Request, cluster *resources, retries bool) {
	retried := func(status int, h http.Header, err error) bool {
		return retries && x.ask(func() bool { return x.rt.retry(status, h, err) })
	}
	go func() {
		release, err := cluster.acquire(req.Context())
		if err != nil {
			if errors.Is(err, errOverflow) {
				x.post(x.onUpstreamOverflow)
			}
			return
		}
		defer release()
		resp, err := x.p.transport.RoundTrip(req)
		if err != nil && retried(0, nil, err) {
			return
		}
		if err != nil {
			x.post(func() { x.onUpstreamError(err, false) })
			return
		}
		defer resp.Body.Close()
		if retried(resp.StatusCode, resp.Header, nil) {
			return
		}
		h := &headerMap{}
		h.add(":status", strconv.Itoa(resp.StatusCode))
		fromHTTPHeader(resp.Header, h)
		if resp.ContentLength >= 0 && !h.has("content-length") && req.Method != http.MethodHead {
			h.add("content-length", strconv.FormatInt(resp.ContentLength, 10))
		}
		noBody := req.Method == http.MethodHead || resp.StatusCode == http.StatusNoContent ||
			resp.StatusCode == http.StatusNotModified || resp.ContentLength == 0
		if !x.post(func() { x.onUpstreamHeaders(h, noBody) }) || noBody {
			return
		}
		// As Envoy's HTTP/1 client codec: each read is data without
		// end_stream (onBody), and the body ends with the trailers or with
		// an empty data callback with end_stream (onMessageCompleteBase).
		buf := make([]byte, 32<<10)
		for {
			n, err := resp.Body.Read(buf)
			if n > 0 {
				chunk := append([]byte(nil), buf[:n]...)
				if !x.post(func() { x.onUpstreamData(chunk, false, nil) }) {
					return
				}
			}
			if errors.Is(err, io.EOF) {
				var tr *headerMap
				if len(resp.Trailer) > 0 {
					tr = &headerMap{}
					fromHTTPHeader(resp.Trailer, tr)
				}
				x.post(func() { x.onUpstreamData(nil, true, tr) })
				return
			}
			if err != nil {
				x.post(func() { x.onUpstreamError(err, true) })
				return
			}
		}
	}()
}

func (x *exchange) onUpstreamHeaders(h *headerMap, noBody bool) {
	if x.finished {
		return
	}
	x.resetIdle()
	x.rt.releaseRetry()
	if noBody {
		x.rt.timer.stop()
	}
	if x.cfg.GatewayFallbacks {
		setServed(x.md.stream, x.rt.attempts.at)
	}
	x.enc.onHeaders(h, noBody)
}

func (x *exchange) onUpstreamData(b []byte, end bool, tr *headerMap) {
	if x.finished {
		return
	}
	x.resetIdle()
	if end {
		x.rt.timer.stop()
	}
	if tr != nil && len(tr.entries) > 0 {
		x.enc.onTrailers(tr)
		return
	}
	x.enc.onData(b, end)
}

func (x *exchange) onUpstreamOverflow() {
	if !x.finished {
		x.logf("upstream overflow: the cluster's circuit breakers are full")
		x.upstreamOverflow()
	}
}

func (x *exchange) onUpstreamError(err error, afterHeaders bool) {
	if x.finished {
		return
	}
	x.logf("upstream error: %v", err)
	if afterHeaders || x.down.started {
		x.finished, x.abort = true, true
		return
	}
	flag, body, details := resetReply(err, x.rt.attempts.made > 1)
	x.localReply(http.StatusServiceUnavailable, flag, body, details)
}

// streamBody is the upstream request body: the event loop pushes, the
// transport reads. Never blocks the loop.
type streamBody struct {
	mu       sync.Mutex
	cond     *sync.Cond
	bufs     [][]byte
	ended    bool
	trailers *headerMap
	err      error
	// trailerDst is the request's Trailer map. It is written from Read, on
	// the transport goroutine that later reads it, so no lock is needed.
	trailerDst http.Header
}

func newStreamBody() *streamBody {
	b := &streamBody{}
	b.cond = sync.NewCond(&b.mu)
	return b
}

func (b *streamBody) push(p []byte) {
	b.mu.Lock()
	b.bufs = append(b.bufs, append([]byte(nil), p...))
	b.mu.Unlock()
	b.cond.Broadcast()
}

func (b *streamBody) end(t *headerMap) {
	b.mu.Lock()
	b.ended, b.trailers = true, t
	b.mu.Unlock()
	b.cond.Broadcast()
}

func (b *streamBody) abort(err error) {
	b.mu.Lock()
	if b.err == nil {
		b.err = err
	}
	b.mu.Unlock()
	b.cond.Broadcast()
}

func (b *streamBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for len(b.bufs) == 0 && !b.ended && b.err == nil {
		b.cond.Wait()
	}
	if len(b.bufs) > 0 {
		n := copy(p, b.bufs[0])
		if b.bufs[0] = b.bufs[0][n:]; len(b.bufs[0]) == 0 {
			b.bufs = b.bufs[1:]
		}
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	if b.trailers != nil && b.trailerDst != nil {
		for _, e := range b.trailers.entries {
			b.trailerDst.Add(http.CanonicalHeaderKey(e.key), e.value)
		}
		b.trailers = nil
	}
	return 0, io.EOF
}

func (b *streamBody) Close() error {
	b.abort(errors.New("body closed"))
	return nil
}
