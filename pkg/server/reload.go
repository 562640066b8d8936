package server

import (
	"cmp"

	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// logConfigReloaded is the line a reload writes: what the pools now are,
// and every changed key that waits for a restart (pending); then what the
// config in force, run, lacks or gets wrong (warnNoPool, warnConfig).
func logConfigReloaded(log logr.Logger, path string, pending []string, run *config.Config, paired string) {
	if len(pending) > 0 {
		log.Info("config reloaded, but these keys take effect only on restart and keep their running values",
			"path", path, "restartPending", pending, "prefill", run.Pools.Prefill.Endpoints, "decode", run.Pools.Decode.Endpoints)
	} else {
		log.Info("config reloaded", "path", path, "prefill", run.Pools.Prefill.Endpoints, "decode", run.Pools.Decode.Endpoints)
	}
	warnNoPool(log, path, run, paired)
	warnConfig(log, run)
}

// warnConfig names what the config sets that does not work as written: keys
// ignored without the key that turns them on, an override of Envoy's
// message timer shorter than routing may take, and slow scrapes where
// requests may be held.
func warnConfig(log logr.Logger, c *config.Config) {
	if keys := c.Ignored(); len(keys) > 0 {
		log.Info("these keys do nothing without the key that turns them on, and are ignored", "ignored", keys)
	}
	if short := c.ShortOverride(); short != "" {
		log.Info(short)
	}
	warnSlowScrapes(log, c)
}

// warnSlowScrapes says to scrape more often the pools scraped less often
// than config.HeldScrape where requests may be held (Config.SlowScrapes).
func warnSlowScrapes(log logr.Logger, c *config.Config) {
	for _, s := range c.SlowScrapes() {
		log.Info("requests may be held for room (admission.hold), and are let go as each scrape of the engines shows it: "+
			"scrape every 250ms or less where requests may be shed (docs/scheduling.md, Scrape often)",
			"key", s.Key, "interval", s.Interval.String())
	}
}

// warnNoPool says what to set when the config names no engine of a pool
// requests need: the decode pool (the embedded default, or a file without
// pools.decode), or the prefill pool under paired, the running connector
// when its decode engines serve only pairs (kv-sglang; else ""). The server
// runs but stays not ready, since no request can be routed.
func warnNoPool(log logr.Logger, path string, c *config.Config, paired string) {
	source := cmp.Or(path, "the embedded default config (no --config given)")
	switch {
	case !c.Pools.Decode.Configured():
		log.Info("no decode engine is configured: pd-extproc routes nothing and stays not ready until the config names one; "+
			"set pools.decode.endpoints (ip:port), pools.decode.dns (a headless Service) or pools.decode.kubernetes, "+
			"and the prefill pool the same way, in a file given with --config (README, Configuration)",
			"config", source)
	case paired != "" && !c.Pools.Prefill.Configured():
		log.Info("no prefill engine is configured: under "+paired+" the decode engines serve only prefill/decode pairs, "+
			"so pd-extproc routes nothing and stays not ready until the config names one; "+
			"set pools.prefill.endpoints (ip:port), pools.prefill.dns (a headless Service) or pools.prefill.kubernetes "+
			"(README, Configuration)",
			"config", source)
	}
}
