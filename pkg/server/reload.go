package server

import (
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// warnNoDecodePool says what to set when the config names no decode engine
// (the embedded default, or a file without pools.decode): the server runs but
// stays not ready, since no request can be routed.
func warnNoDecodePool(log logr.Logger, path string, c *config.Config) {
	if c.Pools.Decode.Configured() {
		return
	}
	source := path
	if source == "" {
		source = "the embedded default config (no --config given)"
	}
	log.Info("no decode engine is configured: pd-extproc routes nothing and stays not ready until the config names one; "+
		"set pools.decode.endpoints (ip:port), pools.decode.dns (a headless Service) or pools.decode.kubernetes, "+
		"and the prefill pool the same way, in a file given with --config (README, Configuration)",
		"config", source)
}
