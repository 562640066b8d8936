package scheduling

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/pd-extproc/pd-extproc/pkg/enginehttp"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
)

// role is what a pool's engines do in a P/D pair. It names the pool and
// decides which of an engine's P/D queues count as its load (parseLoad).
type role uint8

const (
	roleUnknown role = iota // a pool built on its own (tests): no P/D queue counts
	rolePrefill
	roleDecode
)

func (r role) String() string {
	switch r {
	case rolePrefill:
		return "prefill"
	case roleDecode:
		return "decode"
	}
	return "pool"
}

// probe is how a pool's health checks and /metrics scrapes reach its
// engines, and what else it asks them.
type probe struct {
	client *http.Client
	scheme string // http, or https when the engines serve TLS
	role   role
	// rendezvous is what the engines are asked of themselves for the decode
	// leg to find them (a kv-sglang or kv-mooncake prefill pool;
	// serverinfo.go), and bootstrapPort the pool's bootstrap port.
	rendezvous    kv.Rendezvous
	bootstrapPort int
}

func (p probe) url(addr, path string) string { return p.scheme + "://" + addr + path }

// probe returns how the pool of role r reaches its engines: over HTTPS with
// tlsCfg when it is set, with the deps' client when one was given (tests) or
// else one of its own that trusts what tlsCfg trusts; each request with the
// pool's API key when it has one.
func (d Deps) probe(r role, tlsCfg *tls.Config, key *enginehttp.Key, clientGiven bool) probe {
	p := probe{client: d.Client, scheme: "http", role: r}
	if tlsCfg != nil {
		p.scheme = "https"
		if !clientGiven {
			p.client = probeClient(tlsCfg)
		}
	}
	p.client = key.Client(p.client)
	return p
}

// probeClient is the client of checks, scrapes and questions (a decode
// engine's token ids, posted): engines are addressed directly (no
// environment proxy), a couple of connections kept per engine, each closed
// before the engine would close it.
// A redirect is the engine's answer, not followed: an endpoint must not send
// pd-extproc's requests to a host outside its pool, nor vouch with its
// answer.
func probeClient(tlsCfg *tls.Config) *http.Client {
	dialer := &net.Dialer{Timeout: 2 * time.Second}
	t := &http.Transport{
		Proxy:               nil,
		DialContext:         dialer.DialContext,
		MaxIdleConnsPerHost: 2,
		IdleConnTimeout:     enginehttp.IdleConnTimeout,
	}
	if tlsCfg != nil {
		t.DialTLSContext = enginehttp.DialTLS(tlsCfg, dialer.DialContext)
	}
	return &http.Client{Transport: t, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// probeEach runs work on every endpoint at once, and returns when all are
// done. Not in batches: engines that hang would each hold a batch's place
// for a whole timeout, and a round would take as many timeouts as batches,
// its figures going stale meanwhile. What a probe costs is small (a /metrics
// answer is read for its few gauges: loadLines).
func probeEach(eps []*Endpoint, work func(*Endpoint)) {
	var wg sync.WaitGroup
	for _, e := range eps {
		wg.Go(func() { work(e) })
	}
	wg.Wait()
}

// getJSON asks url within timeout and decodes a 200's body, at most limit
// bytes of it, into v. status is the answer's (0 when none came); any other
// than 200 is an error, and its body is read off so that the connection is
// reused.
func (p probe) getJSON(ctx context.Context, url string, timeout time.Duration, limit int64, v any) (status int, err error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return resp.StatusCode, fmt.Errorf("%s answered %d", url, resp.StatusCode)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, limit)).Decode(v); err != nil {
		return resp.StatusCode, fmt.Errorf("%s: %w", url, err)
	}
	return resp.StatusCode, nil
}
