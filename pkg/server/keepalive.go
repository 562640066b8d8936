package server

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// Keepalive is how the gRPC server watches its connections from Envoy, each of
// which carries the streams of many generations for as long as they run. An
// Envoy whose kernel still acknowledges but which answers nothing (a hung or
// frozen process) is found by HTTP/2 pings; a lost node, by TCP keepalive and
// TCP_USER_TIMEOUT, which grpc-go sets to Timeout. And Envoy's own pings are
// let through.
type Keepalive struct {
	// Ping is how long a connection may stay silent before the server pings
	// Envoy, and Timeout how long it then waits for the answer before it
	// closes the connection (and ends the streams on it).
	Ping, Timeout time.Duration
	// MinPeerPing is the shortest interval at which Envoy may ping the server
	// (its http2_protocol_options.connection_keepalive). grpc-go's default, 5
	// minutes, answers faster pings with GOAWAY too_many_pings, which cuts
	// every stream on the connection.
	MinPeerPing time.Duration
}

// DefaultKeepalive pings a silent Envoy every 30 s, waits 20 s for the answer
// (grpc-go's own default, and its TCP_USER_TIMEOUT), and takes Envoy's own
// pings every 10 s or more.
var DefaultKeepalive = Keepalive{Ping: 30 * time.Second, Timeout: 20 * time.Second, MinPeerPing: 10 * time.Second}

// serverOptions are k as gRPC server options, its zero fields the defaults.
func (k Keepalive) serverOptions() []grpc.ServerOption {
	or := func(v, def time.Duration) time.Duration {
		if v <= 0 {
			return def
		}
		return v
	}
	return []grpc.ServerOption{
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: or(k.Ping, DefaultKeepalive.Ping), Timeout: or(k.Timeout, DefaultKeepalive.Timeout)}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: or(k.MinPeerPing, DefaultKeepalive.MinPeerPing), PermitWithoutStream: true}),
	}
}
