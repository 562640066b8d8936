package config

import (
	"slices"
	"strings"
)

// This file holds the keys that do nothing without the key that turns them
// on. They are accepted, so that a file that loaded before still does, and
// named in a warning at load and at reload.

// Ignored names each key of the file that does nothing without the key that
// turns it on, as "key (needs switch)", the prefill pool's first, admission's
// last.
func (c *Config) Ignored() []string { return c.ignored }

// ignored reads the keys as written, before the defaults fill them.
func (p Pools) ignored() []string {
	var keys []string
	for _, n := range p.named() {
		keys = append(keys, n.PoolScheduling.ignored("pools."+n.name)...)
	}
	return keys
}

// ignored is the pool's, under key ("pools.decode"). health.check_timeout
// is not: it also bounds the model lists and server info asked of every
// engine.
func (s PoolScheduling) ignored(key string) []string {
	const checks, scrapes = "health.check_interval", "metrics.interval"
	h, m := s.Health, s.Metrics
	var keys []string
	for _, k := range []struct {
		set            bool
		name, switchOn string
	}{
		{s.dnsIntervalIgnored(), "dns_interval", "dns"},
		{h.CheckInterval == 0 && h.CheckPath != "", "health.check_path", checks},
		{h.CheckInterval == 0 && h.UnhealthyThreshold != 0, "health.unhealthy_threshold", checks},
		{h.CheckInterval == 0 && h.HealthyThreshold != 0, "health.healthy_threshold", checks},
		{m.Interval == 0 && m.Path != "", "metrics.path", scrapes},
		{m.Interval == 0 && m.Timeout != 0, "metrics.timeout", scrapes},
		{m.Interval == 0 && m.StaleAfter != 0, "metrics.stale_after", scrapes},
	} {
		if k.set {
			keys = append(keys, key+"."+k.name+" (needs "+key+"."+k.switchOn+")")
		}
	}
	return keys
}

// dnsIntervalIgnored holds as written and with the defaults filled: the
// default dns_interval follows dns.
func (s PoolScheduling) dnsIntervalIgnored() bool { return s.DNS == "" && s.DNSInterval != 0 }

// dnsIgnored is keys with the pool's dns_interval named as s, the pool in
// force, runs it: a reload that switches the pool's discovery keeps its
// running dns and dns_interval, not the file's (inForce). The entry is its
// pool's first, as ignored gives it.
func (s PoolScheduling) dnsIgnored(keys []string, pool string) []string {
	key := "pools." + pool
	entry := key + ".dns_interval (needs " + key + ".dns)"
	keys = slices.DeleteFunc(slices.Clone(keys), func(k string) bool { return k == entry })
	if !s.dnsIntervalIgnored() {
		return keys
	}
	i := slices.IndexFunc(keys, func(k string) bool { return pool == "prefill" || !strings.HasPrefix(k, "pools.prefill.") })
	if i < 0 {
		i = len(keys)
	}
	return slices.Insert(keys, i, entry)
}

// ignored is admission's: every key but objectives bears on the requests it
// may shed alone, and none is shed without a negative priority.
func (a Admission) ignored() []string {
	if a.Sheds() {
		return nil
	}
	var keys []string
	for _, k := range []struct {
		set  bool
		name string
	}{
		{a.SaturatedQueue != 0, "saturated_queue"},
		{a.SaturatedKVCache != 0, "saturated_kv_cache"},
		{a.Hold != nil, "hold"},
		{a.MaxHeld != 0, "max_held"},
		{a.RetryAfter != 0, "retry_after"},
	} {
		if k.set {
			keys = append(keys, "admission."+k.name+" (needs an objective of negative priority under admission.objectives)")
		}
	}
	return keys
}
