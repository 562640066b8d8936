// Package pipeline runs the prefill/decode flow of one request: parse the body,
// decide P/D or decode-only, pick the endpoints, run or launch the prefill leg,
// and build the body Envoy forwards to the decode endpoint. It knows the engines
// only through kv connectors and never sees the ext_proc protocol.
package pipeline

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/body"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Options are the pipeline's settings, taken from the config file.
type Options struct {
	PrefillTimeout time.Duration
	OnFailure      string // config.OnFailureDecodeOnly or config.OnFailureFail
	BootstrapPort  int
	MaxBodyBytes   int64
}

// Pipeline routes requests. It is safe for concurrent use.
type Pipeline struct {
	connector       kv.Connector
	prefill, decode *scheduling.Pool
	opts            Options
	client          *http.Client
	log             logr.Logger
	background      sync.WaitGroup // concurrent (SGLang) prefill legs still running
}

// New builds a pipeline from a validated config.
func New(cfg *config.Config, log logr.Logger) (*Pipeline, error) {
	c, err := kv.Build(cfg.Connector)
	if err != nil {
		return nil, err
	}
	return &Pipeline{
		connector: c,
		prefill:   scheduling.NewPool("prefill", cfg.Pools.Prefill.Endpoints),
		decode:    scheduling.NewPool("decode", cfg.Pools.Decode.Endpoints),
		opts: Options{
			PrefillTimeout: cfg.Prefill.Timeout.D(),
			OnFailure:      cfg.Prefill.OnFailure,
			BootstrapPort:  cfg.Pools.Prefill.BootstrapPort,
			MaxBodyBytes:   cfg.Limits.MaxBodyBytes,
		},
		client: newEngineClient(),
		log:    log,
	}, nil
}

// MaxBodyBytes is the largest request body accepted.
func (p *Pipeline) MaxBodyBytes() int64 { return p.opts.MaxBodyBytes }

// Request is what the pipeline needs of one client request.
type Request struct {
	Path      string      // :path, query included
	RequestID string      // sent on both legs
	Forward   http.Header // client headers copied onto the prefill leg (e.g. Authorization)
	Body      []byte      // nil for a request without a body
}

// Modes of a routed request.
const (
	ModePD         = "pd"
	ModeDecodeOnly = "decode_only"
)

// Decision is where a request goes and with which body.
type Decision struct {
	Endpoint string // decode endpoint, ip:port
	Body     []byte // the decode leg's body; nil when the request has none
	Mode     string
	release  func()
}

// Release frees the decode endpoint's slot; call it when the exchange ends.
func (d *Decision) Release() {
	if d != nil && d.release != nil {
		d.release()
	}
}

// RouteHeaders routes a request that has no body to a decode endpoint.
func (p *Pipeline) RouteHeaders(r *Request) (*Decision, error) {
	ep := p.decode.Pick()
	if ep == nil {
		return nil, noDecodeEndpoint()
	}
	return &Decision{Endpoint: ep.Addr, Mode: ModeDecodeOnly, release: ep.Acquire()}, nil
}

// Route runs the flow for a request with a body. Errors are *Error.
func (p *Pipeline) Route(ctx context.Context, r *Request) (*Decision, error) {
	path, _, _ := strings.Cut(r.Path, "?")
	if path != "/v1/chat/completions" && path != "/v1/completions" {
		return nil, notFound(path)
	}
	if int64(len(r.Body)) > p.opts.MaxBodyBytes {
		return nil, TooLarge(p.opts.MaxBodyBytes)
	}
	obj, err := body.Parse(r.Body)
	if err != nil {
		return nil, badRequest("%v", err)
	}
	if model, ok := obj.String("model"); !ok || model == "" {
		return nil, badRequest("the request has no \"model\" string")
	}
	decode := p.decode.Pick()
	if decode == nil {
		return nil, noDecodeEndpoint()
	}
	d := &Decision{Endpoint: decode.Addr, release: decode.Acquire()}
	d.Body, d.Mode, err = p.legs(ctx, r, obj)
	if err != nil {
		d.Release()
		return nil, err
	}
	return d, nil
}

// legs decides P/D or decode-only and returns the decode leg's body.
func (p *Pipeline) legs(ctx context.Context, r *Request, obj *body.Object) ([]byte, string, error) {
	if n, ok := obj.Int("n"); ok && n > 1 {
		return kv.Scrubbed(obj), ModeDecodeOnly, nil // vLLM cannot hand off n>1 sequences
	}
	prefill := p.prefill.Pick()
	if prefill == nil {
		return kv.Scrubbed(obj), ModeDecodeOnly, nil
	}
	h := &kv.Handoff{
		Body:          obj,
		PrefillHost:   bootstrapHost(prefill.Addr),
		BootstrapPort: p.opts.BootstrapPort,
		Room:          rand.Uint64() >> 1, // 0..2^63-1, as SGLang's routers draw it
	}
	if p.connector.Dispatch() == kv.Concurrent {
		p.launch(ctx, prefill, r, kv.PrefillBody(p.connector, h))
		return kv.DecodeBody(p.connector, h), ModePD, nil
	}
	params, err := p.runPrefill(ctx, prefill, r, kv.PrefillBody(p.connector, h))
	if err != nil {
		var e *Error
		if errors.As(err, &e) || p.opts.OnFailure == config.OnFailureFail || ctx.Err() != nil {
			return nil, "", failure(err)
		}
		p.log.Info("prefill failed; decode will recompute the prompt", "requestID", r.RequestID, "error", err.Error())
		return kv.Scrubbed(obj), ModeDecodeOnly, nil
	}
	if params == nil && p.connector.Name() == kv.NIXL {
		p.log.Info("prefill returned no kv_transfer_params; decode will recompute the prompt",
			"requestID", r.RequestID, "prefill", prefill.Addr)
	}
	h.PrefillKV = params
	return kv.DecodeBody(p.connector, h), ModePD, nil
}

// runPrefill sends the prefill leg, retrying once on another endpoint after a
// failure another endpoint might not have. An engine 4xx comes back as *Error.
func (p *Pipeline) runPrefill(ctx context.Context, first *scheduling.Endpoint, r *Request, leg []byte) ([]byte, error) {
	ep, tried := first, []string{}
	for {
		release := ep.Acquire()
		params, err := p.postPrefill(ctx, ep.Addr, r, leg)
		release()
		if err == nil {
			return params, nil
		}
		if se, ok := err.(*statusError); ok && !retryable(err) {
			return nil, engineError(se.status, se.body, se.contentType)
		}
		tried = append(tried, ep.Addr)
		if ctx.Err() != nil || len(tried) > 1 {
			return nil, err
		}
		if ep = p.prefill.Pick(tried...); ep == nil {
			return nil, err
		}
		p.log.V(1).Info("retrying prefill on another endpoint", "requestID", r.RequestID, "failed", tried[0], "error", err.Error())
	}
}

// launch sends a concurrent prefill leg in the background. It runs on its own
// deadline: Envoy closes the ext_proc stream as soon as its last reply is in,
// which must not cancel a leg the decode engine is waiting to pair with.
func (p *Pipeline) launch(ctx context.Context, ep *scheduling.Endpoint, r *Request, leg []byte) {
	release := ep.Acquire()
	ctx = context.WithoutCancel(ctx)
	p.background.Go(func() {
		defer release()
		if _, err := p.postPrefill(ctx, ep.Addr, r, leg); err != nil {
			p.log.Info("concurrent prefill leg failed", "requestID", r.RequestID, "prefill", ep.Addr, "error", err.Error())
		}
	})
}

// Wait blocks until every background prefill leg has ended.
func (p *Pipeline) Wait() { p.background.Wait() }

func failure(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return prefillFailed(err)
}

// bootstrapHost is the host part of ip:port, IPv6 in brackets as SGLang expects.
func bootstrapHost(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if strings.Contains(host, ":") {
		return "[" + host + "]"
	}
	return host
}
