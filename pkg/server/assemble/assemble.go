// Package assemble builds the pipeline from the config file: its
// connector, API table, pools and engine client, its options, and what a
// reload applies. pkg/server uses it, and so do the tests that need a
// configured pipeline, without the server's Kubernetes and gRPC parts.
package assemble

import (
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/config"
	"github.com/pd-extproc/pd-extproc/pkg/enginehttp"
	"github.com/pd-extproc/pd-extproc/pkg/kv"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"
)

// Pipeline builds the pipeline of a validated config: its connector, API
// table, pools (whose health checks and scrapes speak as each pool's engines
// serve: the prefill pool as the prefill legs, the decode pool as
// pools.decode.tls says) and the engine client.
func Pipeline(cfg *config.Config, log logr.Logger, options ...pipeline.Option) (*pipeline.Pipeline, error) {
	c, err := kv.Build(cfg.Connector)
	if err != nil {
		return nil, err
	}
	client, scheme, err := enginehttp.Client(cfg.Prefill)
	if err != nil {
		return nil, err
	}
	routes, err := api.ParseRoutes("routes.passthrough", cfg.Routes.Passthrough)
	if err != nil {
		return nil, err
	}
	deps := scheduling.Deps{Log: log.WithName("scheduling")}
	if deps.PrefillTLS, err = enginehttp.TLS("prefill.tls", cfg.Prefill.TLS); err != nil {
		return nil, err
	}
	if deps.DecodeTLS, err = enginehttp.TLS("pools.decode.tls", cfg.Pools.Decode.TLS); err != nil {
		return nil, err
	}
	if deps.PrefillKey, err = enginehttp.APIKey("prefill.api_key_file", cfg.Prefill.APIKeyFile); err != nil {
		return nil, err
	}
	if deps.DecodeKey, err = enginehttp.APIKey("pools.decode.api_key_file", cfg.Pools.Decode.APIKeyFile); err != nil {
		return nil, err
	}
	spec := schedulingSpec(cfg)
	spec.Paired, spec.Rendezvous, spec.BootstrapPort = c.Paired(), c.Rendezvous(), cfg.Pools.Prefill.BootstrapPort
	parts := pipeline.Parts{Connector: c, Table: api.NewTable(routes, decodeOnly(cfg)...), Pools: scheduling.NewPools(spec, deps),
		Client: deps.PrefillKey.Client(client), Scheme: scheme, DecodeKey: deps.DecodeKey}
	return pipeline.New(parts, pipelineOptions(cfg), log, options...), nil
}

// decodeOnly lists the built-in APIs the config sends to a decode engine alone.
func decodeOnly(cfg *config.Config) []*api.API {
	var apis []*api.API
	if cfg.Routes.MessagesDecodeOnly {
		apis = append(apis, api.Messages)
	}
	if cfg.Routes.ResponsesDecodeOnly {
		apis = append(apis, api.Responses)
	}
	return apis
}

func pipelineOptions(cfg *config.Config) pipeline.Options {
	return pipeline.Options{
		PrefillTimeout:   cfg.Prefill.Timeout.D(),
		AttemptTimeout:   cfg.Prefill.AttemptTimeout.D(),
		Attempts:         cfg.Prefill.Attempts,
		FailClosed:       cfg.Prefill.OnFailure == config.OnFailureFail,
		MaxBodyBytes:     cfg.Limits.MaxBodyBytes,
		Connector:        cfg.Connector,
		RewriteUsage:     cfg.Response.RewriteUsage,
		MaxResponseBytes: cfg.Response.MaxBodyBytes,
		MaxBackground:    cfg.Prefill.MaxBackground,
		RetryAfter:       cfg.Limits.RetryAfter.D(),
		PairBuiltinTools: cfg.Routes.PairBuiltinTools,
		Shedding:         shedding(cfg),
	}
}

// schedulingSpec is the part of cfg that scheduling follows, and that a
// config reload can change without a restart.
func schedulingSpec(cfg *config.Config) scheduling.Spec {
	return scheduling.Spec{
		Prefill: scheduling.PoolSpec{Endpoints: cfg.Pools.Prefill.Endpoints, PoolScheduling: cfg.Pools.Prefill.PoolScheduling},
		Decode:  scheduling.PoolSpec{Endpoints: cfg.Pools.Decode.Endpoints, PoolScheduling: cfg.Pools.Decode.PoolScheduling},
		PD:      cfg.PD,
	}
}

// Reload applies what a reloaded config changes in place: the pools, their
// scheduling keys, the pd.* and admission.* keys (config.LiveKeys).
func Reload(p *pipeline.Pipeline, cfg *config.Config) {
	p.Reload(schedulingSpec(cfg))
	p.SetShedding(shedding(cfg))
}

func shedding(cfg *config.Config) pipeline.Shedding {
	a := cfg.Admission
	return pipeline.Shedding{Priorities: a.Objectives, Lines: scheduling.Lines{Queue: a.SaturatedQueue, KVCache: a.SaturatedKVCache},
		Hold: a.Held().D(), MaxHeld: a.MaxHeld, RetryAfter: a.RetryAfter.D()}
}
