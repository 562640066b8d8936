package config

// This file holds what a reload applies (LiveKeys), the config it then runs
// (inForce) and the keys that wait for a restart (restartPending).

import (
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
)

// LiveKeys are the keys a reload applies in place, and the keys below them,
// as a user writes them: what assemble.Reload hands to the pipeline (each
// pool's endpoints and scheduling keys, the P/D decider, the shedding).
// Every other key takes effect on restart only: a key added to the config
// is restart-only until it is listed here, which the config in force, its
// check and the reload's log line all follow.
var LiveKeys = []string{
	"pools.prefill.endpoints", "pools.decode.endpoints",
	"pools.prefill.policy", "pools.decode.policy",
	"pools.prefill.prefix", "pools.decode.prefix",
	"pools.prefill.health", "pools.decode.health",
	"pools.prefill.metrics", "pools.decode.metrics",
	"pools.prefill.dns", "pools.decode.dns",
	"pools.prefill.dns_interval", "pools.decode.dns_interval",
	"pools.prefill.kv_events", "pools.decode.kv_events",
	"pools.decode.fallbacks",
	"pd",
	"admission",
}

// reloadable is c, the file, as a reload after prev runs it (inForce), and
// the keys of c that wait for a restart; an error when the config in force
// would be refused: a running kv-sglang cannot take pd.mode never, whatever
// the file now names, and a pool whose engines Kubernetes finds must be
// scraped for shedding, though the file drops its kubernetes key.
func (c *Config) reloadable(started, prev *Config) (*Config, []string, error) {
	run := c.inForce(started, prev)
	pending := restartPending(run, c)
	if err := run.validate(); err != nil {
		return nil, nil, fmt.Errorf("config: with the running %s (a new value takes a restart): %w", strings.Join(pending, ", "), err)
	}
	return run, pending, nil
}

// inForce is c as a reload after prev runs it, started being the config
// the process started with: started, with c's LiveKeys. A pool whose
// kubernetes key c adds or drops keeps prev's endpoints, dns and
// dns_interval until the restart: Kubernetes discovery starts and stops
// only with the process, and the file's sources alone would empty the
// pool, or mix with those it drops. Its dns_interval is then ignored as
// prev's dns makes it.
func (c *Config) inForce(started, prev *Config) *Config {
	run := *started
	for _, key := range LiveKeys {
		keyField(&run, key).Set(keyField(c, key))
	}
	run.ignored = c.ignored // of live keys only (ignored.go)
	for _, p := range []struct {
		name            string
		run, file, prev *Pool
	}{
		{"prefill", &run.Pools.Prefill, &c.Pools.Prefill, &prev.Pools.Prefill},
		{"decode", &run.Pools.Decode, &c.Pools.Decode, &prev.Pools.Decode},
	} {
		if (p.file.Kubernetes == nil) != (p.run.Kubernetes == nil) {
			p.run.Endpoints, p.run.DNS, p.run.DNSInterval = p.prev.Endpoints, p.prev.DNS, p.prev.DNSInterval
			run.ignored = p.run.dnsIgnored(run.ignored, p.name)
		}
	}
	return &run
}

// keyField is the field of c that key, as a user writes it, names.
func keyField(c *Config, key string) reflect.Value {
	v := reflect.ValueOf(c).Elem()
	for name := range strings.SplitSeq(key, ".") {
		fields := reflect.VisibleFields(v.Type()) // with an embedded struct's, whose keys sit beside its parent's
		i := slices.IndexFunc(fields, func(f reflect.StructField) bool { return strings.Split(f.Tag.Get("json"), ",")[0] == name })
		if i < 0 {
			panic("config: no key " + key)
		}
		v = v.FieldByIndex(fields[i].Index)
	}
	return v
}

// restartPending names the keys whose value in file differs from the one in
// force, run: those a reload does not apply, which keep their running
// values until a restart. Keys are named as a user writes them
// (limits.max_concurrent_streams, pools.prefill.kubernetes.selector), each
// leaf once, in order.
func restartPending(run, file *Config) []string {
	return changedKeys(asTree(run), asTree(file), "")
}

// asTree is c as its file would spell it: the keys its JSON tags name, with
// the defaults filled in.
func asTree(c *Config) any {
	js, err := json.Marshal(c)
	if err != nil {
		// Every field of Config marshals; a failure here is a bug in a new type.
		panic(fmt.Sprintf("config does not marshal: %v", err))
	}
	var tree any
	if err := json.Unmarshal(js, &tree); err != nil {
		panic(err)
	}
	return tree
}

// changedKeys lists the leaf keys whose values differ between a and b, under
// prefix. A list is one value; an empty list and a missing one are the same.
func changedKeys(a, b any, prefix string) []string {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if !aok || !bok {
		if empty(a) && empty(b) || reflect.DeepEqual(a, b) {
			return nil
		}
		return []string{prefix}
	}
	var out []string
	for _, k := range slices.Sorted(maps.Keys(union(am, bm))) {
		key := k
		if prefix != "" {
			key = prefix + "." + k
		}
		out = append(out, changedKeys(am[k], bm[k], key)...)
	}
	return out
}

func union(a, b map[string]any) map[string]any {
	out := maps.Clone(a)
	maps.Copy(out, b)
	return out
}

func empty(v any) bool {
	l, ok := v.([]any)
	return v == nil || ok && len(l) == 0
}
