package deploy

import (
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// Every key a config file may set is named in the documents, so that no
// setting is found only by reading the code: in full
// (`pools.decode.fallbacks`), under pools.<pool> for a key of both pools,
// from the pool's key on (`kv_events.stale_after`), or by its last part on a
// line that names its section (`resync` in the row of
// `pools.<pool>.kv_events`).
func TestEveryConfigKeyIsDocumented(t *testing.T) {
	var text strings.Builder
	for _, d := range documents(t) {
		text.WriteString(d.text)
	}
	docs := text.String()
	named := func(k string) bool { return strings.Contains(docs, "`"+k+"`") }
	inSection := func(k string) bool {
		i := strings.LastIndexByte(k, '.')
		if i < 0 {
			return false
		}
		section, leaf := "`"+k[:i]+"`", "`"+k[i+1:]+"`"
		for line := range strings.Lines(docs) {
			if strings.Contains(line, section) && strings.Contains(line, leaf) {
				return true
			}
		}
		return false
	}
	keys := configKeys(reflect.TypeFor[config.Config](), "")
	for _, k := range keys {
		if strings.HasPrefix(k, "pools.prefill.tls.") {
			continue // refused: the prefill pool's checks and scrapes follow prefill.tls
		}
		pool, inPool := "", false
		for _, p := range []string{"pools.prefill.", "pools.decode."} {
			if rest, ok := strings.CutPrefix(k, p); ok {
				pool, inPool = rest, true
			}
		}
		general := "pools.<pool>." + pool
		if named(k) || inPool && (named(general) || strings.Contains(pool, ".") && (named(pool) || inSection(general))) || inSection(k) {
			continue
		}
		t.Errorf("no document names the config key %s", k)
	}
	if len(keys) < 100 {
		t.Errorf("%d config keys found: has config.Config's shape changed?", len(keys))
	}
}

// configKeys are the dotted keys of the config file under prefix, from t's
// json tags: a struct of this package is a section, anything else a key.
func configKeys(t reflect.Type, prefix string) []string {
	var out []string
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "-":
			continue
		case name == "" && f.Anonymous:
			out = append(out, configKeys(f.Type, prefix)...)
			continue
		case name == "":
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && ft.PkgPath() == t.PkgPath() && ft.NumField() > 0 {
			if sub := configKeys(ft, prefix+name+"."); len(sub) > 0 {
				out = append(out, sub...)
				continue
			}
		}
		out = append(out, prefix+name)
	}
	return out
}

// Every config table row of the documents names a key the parser takes: under pools.<pool>
// for a key of both pools, or a section with .* (the chart's README documents its values,
// checked by TestChartValuesAreDocumented). A row for a key renamed or removed would
// otherwise pass TestDocumentedDefaultsAreApplied unread.
func TestConfigTablesNameKeysThatExist(t *testing.T) {
	keys := configKeys(reflect.TypeFor[config.Config](), "")
	row := regexp.MustCompile("(?m)^\\| `([a-z_<>]+\\.[a-z_<>.*]+)` \\|")
	rows := 0
	for _, d := range documents(t) {
		if strings.HasPrefix(d.rel, "charts") {
			continue
		}
		for _, m := range row.FindAllStringSubmatch(d.text, -1) {
			if strings.HasSuffix(m[1], ".yaml") {
				continue // a file of config/k8s
			}
			rows++
			if !keyExists(keys, m[1]) {
				t.Errorf("%s documents the config key %s, which the parser does not take", d.rel, m[1])
			}
		}
	}
	if rows < 50 {
		t.Errorf("%d config rows found: the tables' shape changed?", rows)
	}
	for _, k := range []string{"pools.decode.fallbacks", "pools.<pool>.health.*", "pools.<pool>.kv_events", "pd.min_prompt_tokens"} {
		if !keyExists(keys, k) {
			t.Errorf("keyExists(%s) = false", k)
		}
	}
	for _, k := range []string{"pools.<pool>.fallback", "pd.min_prompt_token", "routes.passthrough_list", "tracing.otlp.*"} {
		if keyExists(keys, k) {
			t.Errorf("keyExists(%s) = true", k)
		}
	}
}

// keyExists says whether a documented key names keys: exactly, in both pools for
// pools.<pool>, or a section for one ending .* or naming a struct.
func keyExists(keys []string, doc string) bool {
	for _, w := range expandPool(doc) {
		section := strings.TrimSuffix(w, ".*") + "."
		if !slices.Contains(keys, w) && !slices.ContainsFunc(keys, func(k string) bool { return strings.HasPrefix(k, section) }) {
			return false
		}
	}
	return true
}
