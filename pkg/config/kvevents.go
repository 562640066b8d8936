package config

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"time"
)

// KV events defaults.
const (
	DefaultKVEventsStaleAfter    = 30 * time.Second
	DefaultKVEventsResync        = 5 * time.Minute
	DefaultKVEventsMaxPerEngine  = 1 << 17 // blocks: 2M tokens of 16
	DefaultKVEventsMaxBlocks     = 1 << 19 // about 70 MB of index at most (docs/scheduling.md)
	DefaultKVEventsTokenizePath  = "/tokenize"
	DefaultKVEventsTokenizeLimit = 250 * time.Millisecond
	DefaultKVEventsMaxMessage    = 64 << 20 // bytes: a batch of vLLM's is some kilobytes, a long prompt's a few megabytes
	DefaultKVEventsReplayTimeout = 2 * time.Second
)

// KVEvents has a pool follow its engines' KV cache events (vLLM's
// --kv-events-config), so that prefix-affinity knows what each engine
// caches instead of estimating it. Off unless ConnectPort or Bind is set.
type KVEvents struct {
	// ConnectPort: every endpoint's host publishes on this port (vLLM's
	// default endpoint tcp://*:5557), and every replica dials it. The mode
	// for several replicas: each sees every engine's stream.
	ConnectPort int `json:"connect_port,omitempty"`
	// Bind: listen here (tcp://host:port) for engines that connect and
	// publish (a non-wildcard vLLM endpoint); each must set its topic to
	// kv@<ip>:<port>@<model>, its endpoint as the pool lists it. One
	// replica only: the engines publish to one address.
	Bind string `json:"bind,omitempty"`
	// ReplayPort is the engines' replay socket (vLLM's replay_endpoint),
	// asked for the events a gap lost; 0: none, a gap rebuilds the view.
	ReplayPort int `json:"replay_port,omitempty"`
	// ReplayTimeout bounds one ask of the replay socket (default 2s); past
	// it the batches are lost, as without one.
	ReplayTimeout Duration `json:"replay_timeout,omitempty"`
	// DataParallelSize is the ranks of one engine; rank r publishes on
	// ConnectPort+r (and replays on ReplayPort+r), so the two ports must be
	// at least this far apart. 1 with Bind.
	DataParallelSize int `json:"data_parallel_size,omitempty"`
	// StaleAfter bounds how long a view may go unconfirmed (default 30s):
	// one rebuilt after an unreplayed gap, or whose engine was sent new work
	// and published nothing since, is not used for that long; requests then
	// go by the estimate prefix-affinity makes without events.
	StaleAfter Duration `json:"stale_after,omitempty"`
	// Resync: a connection silent this long is made anew (default 5m; the
	// ZeroMQ library can miss a restarted peer, and then delivers nothing).
	Resync Duration `json:"resync,omitempty"`
	// MaxBlocksPerEndpoint and MaxBlocks bound the index's memory, in
	// blocks, per publishing engine and in all.
	MaxBlocksPerEndpoint int `json:"max_blocks_per_endpoint,omitempty"`
	MaxBlocks            int `json:"max_blocks,omitempty"`
	// MaxMessageBytes bounds each message (its frames) read from an
	// engine's publisher or replay socket (default 64 MiB); a longer one
	// drops the connection.
	MaxMessageBytes int `json:"max_message_bytes,omitempty"`
	// Tokenize is how a request's token ids are asked of an engine.
	Tokenize Tokenize `json:"tokenize"`
}

// Tokenize is the engines' tokenizer endpoint.
type Tokenize struct {
	Path    string   `json:"path,omitempty"`    // default /tokenize, vLLM's
	Timeout Duration `json:"timeout,omitempty"` // default 250ms; past it the request goes without events
}

// On reports whether the pool follows its engines' events.
func (k KVEvents) On() bool { return k.ConnectPort != 0 || k.Bind != "" }

// SetDefaults fills the keys left out.
func (k *KVEvents) SetDefaults() {
	if !k.On() {
		return
	}
	orDefault(&k.DataParallelSize, 1)
	orDefault(&k.StaleAfter, Duration(DefaultKVEventsStaleAfter))
	orDefault(&k.Resync, Duration(DefaultKVEventsResync))
	orDefault(&k.ReplayTimeout, Duration(DefaultKVEventsReplayTimeout))
	orDefault(&k.MaxBlocksPerEndpoint, DefaultKVEventsMaxPerEngine)
	orDefault(&k.MaxBlocks, DefaultKVEventsMaxBlocks)
	orDefault(&k.MaxMessageBytes, DefaultKVEventsMaxMessage)
	orDefault(&k.Tokenize.Path, DefaultKVEventsTokenizePath)
	orDefault(&k.Tokenize.Timeout, Duration(DefaultKVEventsTokenizeLimit))
}

// Validate checks the keys under key ("pools.decode.kv_events"); policy is
// the pool's.
func (k KVEvents) Validate(key, policy string) error {
	if !k.On() {
		if k != (KVEvents{}) {
			return fmt.Errorf("%s: set without connect_port or bind, so the pool follows no events: set one, or drop the rest", key)
		}
		return nil
	}
	var errs []error
	if policy != PolicyPrefixAffinity {
		errs = append(errs, fmt.Errorf("%s: needs policy %s (the pool's is %s): only it routes by what the engines cache", key, PolicyPrefixAffinity, policy))
	}
	switch {
	case k.ConnectPort != 0 && k.Bind != "":
		errs = append(errs, fmt.Errorf("%s: connect_port and bind are two modes: set one", key))
	case k.Bind != "":
		if err := validateZMQAddr(k.Bind); err != nil {
			errs = append(errs, fmt.Errorf("%s.bind: %w", key, err))
		}
		if k.DataParallelSize > 1 {
			// vLLM's rank r connects to the bind port + r, under the same
			// topic: one listening port hears rank 0 alone.
			errs = append(errs, fmt.Errorf("%s.data_parallel_size: %d with bind: each rank publishes to the bind port + its rank, "+
				"under one topic, and only the bind port is listened on; use connect_port, which dials every rank", key, k.DataParallelSize))
		}
	}
	for name, port := range map[string]int{"connect_port": k.ConnectPort, "replay_port": k.ReplayPort} {
		if port < 0 || port+max(k.DataParallelSize, 1)-1 > 65535 { // rank r uses port + r
			errs = append(errs, fmt.Errorf("%s.%s: %d is not a port", key, name, port))
		}
	}
	if k.DataParallelSize < 1 || k.DataParallelSize > 256 {
		errs = append(errs, fmt.Errorf("%s.data_parallel_size: %d is not between 1 and 256", key, k.DataParallelSize))
	}
	if n := k.DataParallelSize; k.ConnectPort != 0 && k.ReplayPort != 0 && k.ReplayPort < k.ConnectPort+n && k.ConnectPort < k.ReplayPort+n {
		// vLLM and SGLang add the rank to both ports: one rank's publisher
		// and another's replay socket would bind the same port.
		errs = append(errs, fmt.Errorf("%s.replay_port: %d to %d, the ranks' replay ports, overlap their event ports %d to %d: "+
			"the engines add the rank to both, so they could not start; keep the two %d or more apart", key,
			k.ReplayPort, k.ReplayPort+n-1, k.ConnectPort, k.ConnectPort+n-1, n))
	}
	if k.StaleAfter <= 0 {
		errs = append(errs, fmt.Errorf("%s.stale_after: must be positive", key))
	}
	if k.ReplayTimeout <= 0 {
		errs = append(errs, fmt.Errorf("%s.replay_timeout: must be positive", key))
	}
	if k.Resync < 0 {
		errs = append(errs, fmt.Errorf("%s.resync: must not be negative (0: the default, %s)", key, DefaultKVEventsResync))
	}
	if k.MaxBlocksPerEndpoint < 1 || k.MaxBlocks < k.MaxBlocksPerEndpoint {
		errs = append(errs, fmt.Errorf("%s.max_blocks: %d, per endpoint %d: both positive, the total at least the per endpoint", key, k.MaxBlocks, k.MaxBlocksPerEndpoint))
	}
	if k.MaxMessageBytes < 1<<10 {
		errs = append(errs, fmt.Errorf("%s.max_message_bytes: %d is below 1 KiB, less than a batch of events", key, k.MaxMessageBytes))
	}
	if !strings.HasPrefix(k.Tokenize.Path, "/") {
		errs = append(errs, fmt.Errorf("%s.tokenize.path: %q does not start with /", key, k.Tokenize.Path))
	}
	if k.Tokenize.Timeout <= 0 {
		errs = append(errs, fmt.Errorf("%s.tokenize.timeout: must be positive", key))
	}
	return errors.Join(errs...)
}

// validateZMQAddr accepts tcp://host:port that a listener can bind and
// engines can be told of.
func validateZMQAddr(s string) error {
	hostPort, ok := strings.CutPrefix(s, "tcp://")
	host, port, err := net.SplitHostPort(hostPort)
	n, perr := strconv.Atoi(port)
	switch {
	case !ok || err != nil || perr != nil || n < 0 || n > 65535:
		return fmt.Errorf("%q is not tcp://host:port", s)
	case n == 0:
		return fmt.Errorf("%q has port 0: the system would pick a port no engine can know", s)
	}
	if ip, err := netip.ParseAddr(host); err == nil && notOneHost(ip.Unmap()) != "" {
		return fmt.Errorf("%q is %s: a TCP listener binds one host's address", s, notOneHost(ip.Unmap()))
	}
	return nil
}
