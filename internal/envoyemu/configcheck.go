package envoyemu

import (
	"cmp"
	"errors"
	"fmt"
	"strings"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

func isFullDuplex(m extprocfilterv3.ProcessingMode_BodySendMode) bool {
	return m == extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// Validate applies the ext_proc config checks Envoy runs at load time (§2.6,
// §3.6, §5, §10.1). A config Envoy would reject must not run here either.
func (cfg *Config) Validate() error {
	// §2.6 / SRC-CFG verifyProcessingModeConfig.
	req, resp := cfg.Modes.Request, cfg.Modes.Response
	if isFullDuplex(req.Body) && req.Trailers != extprocfilterv3.ProcessingMode_SEND {
		return errors.New("request_body_mode FULL_DUPLEX_STREAMED requires request_trailer_mode SEND")
	}
	if isFullDuplex(resp.Body) && resp.Trailers != extprocfilterv3.ProcessingMode_SEND {
		return errors.New("response_body_mode FULL_DUPLEX_STREAMED requires response_trailer_mode SEND")
	}
	for _, m := range []extprocfilterv3.ProcessingMode_BodySendMode{req.Body, resp.Body} {
		if m == extprocfilterv3.ProcessingMode_GRPC {
			// §2.7: not-implemented-hide; refusing is safer than guessing.
			return errors.New("body mode GRPC is not emulated")
		}
	}
	if cfg.Mutations.RouteCacheAction != extprocfilterv3.ExternalProcessor_DEFAULT && cfg.Mutations.DisableClearRouteCache {
		return errors.New("route_cache_action and disable_clear_route_cache are mutually exclusive")
	}
	if t := cfg.Failure.MessageTimeout; t < 0 || t > maxTimeout {
		return fmt.Errorf("message_timeout %v out of [0s, 3600s]", t)
	}
	if t := cfg.Failure.MaxMessageTimeout; t < 0 || t > maxTimeout {
		return fmt.Errorf("max_message_timeout %v out of [0s, 3600s]", t)
	}
	if len(cfg.Routes) == 0 {
		return errors.New("no routes")
	}
	for _, r := range cfg.Routes {
		cl := cfg.Clusters[r.Cluster]
		if cl == nil || cl.OriginalDst == nil {
			return fmt.Errorf("route to unknown or non-ORIGINAL_DST cluster %q", r.Cluster)
		}
		if cl.TLS != nil {
			return fmt.Errorf("cluster %q: a transport_socket on a route cluster is not emulated (the router speaks plaintext HTTP/1.1)", r.Cluster)
		}
	}
	for name, cl := range cfg.Clusters {
		if err := cl.TLS.validate(); err != nil {
			return fmt.Errorf("cluster %q: transport_socket: %w", name, err)
		}
	}
	return steeringMutation(cfg.Mutations)
}

// steeringMutation refuses mutation_rules that let the processor set one of
// the x-envoy-* headers Envoy strips from clients because they steer it:
// Envoy's router obeys them when a filter sets them (RetryStateImpl::create
// in source/common/router/retry_state_impl.cc, FilterUtility::finalTimeout
// in router.cc), the emulator's reads none.
func steeringMutation(m Mutations) error {
	r, err := rules.NewHeaderRules(m.Rules, m.HeaderPrefix)
	if err != nil {
		return err
	}
	prefix := cmp.Or(strings.ToLower(m.HeaderPrefix), "x-envoy")
	for _, n := range steering {
		if r.Check(rules.OpSet, prefix+n, "1") == rules.CheckOK {
			return fmt.Errorf("mutation_rules let the processor set %s%s, which Envoy's router obeys: not emulated (exclude it with disallow_expression)", prefix, n)
		}
	}
	return nil
}

// withDefaults fills zero values a hand-made Config may leave out.
func (cfg Config) withDefaults() Config {
	if cfg.Failure.StatusOnError == 0 {
		cfg.Failure.StatusOnError = 500
	}
	if cfg.Limits.BufferLimitBytes == 0 {
		cfg.Limits.BufferLimitBytes = defaultBufferLimit
	}
	if cfg.Limits.MaxHeadersCount == 0 {
		cfg.Limits.MaxHeadersCount = defaultMaxHeadersCount
	}
	if cfg.Limits.MaxHeadersKB == 0 {
		cfg.Limits.MaxHeadersKB = defaultMaxHeadersKB
	}
	if cfg.Mutations.HeaderPrefix == "" {
		cfg.Mutations.HeaderPrefix = "x-envoy"
	}
	clusters := make(map[string]*Cluster, len(cfg.Clusters))
	for name, cl := range cfg.Clusters {
		c := *cl
		if c.Breakers == (Thresholds{}) {
			c.Breakers = DefaultThresholds
		}
		if c.StreamsPerConnection == 0 {
			c.StreamsPerConnection = 1 // HTTP/1, as an ORIGINAL_DST cluster here
			if name == cfg.ExtProcCluster {
				c.StreamsPerConnection = defaultHTTP2Streams // gRPC is HTTP/2
			}
		}
		clusters[name] = &c
	}
	cfg.Clusters = clusters
	return cfg
}
