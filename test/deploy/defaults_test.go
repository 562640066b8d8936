package deploy

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
	"github.com/pd-extproc/pd-extproc/pkg/config"
)

// The config reference's defaults are the ones the service applies: each row
// of a config table whose default is a literal (a number, a duration, a word)
// reads as the value config.Parse gives that key in a file that leaves it
// out. A key under pools.<pool> is read in both pools.
func TestDocumentedDefaultsAreApplied(t *testing.T) {
	cfg, err := config.Parse([]byte("connector: kv-nixl\n"))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var applied map[string]any
	if err := json.Unmarshal(raw, &applied); err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `([a-z_<>.]+)` \\| ([^|]*?) \\|")
	literal := regexp.MustCompile("^`([^`]+)`( \\([^)]*\\))?$") // `30s`, or `0` (off): not `1`; `4` for …
	checked, later := 0, 0
	for _, doc := range []string{"README.md", "docs/scheduling.md"} {
		for _, m := range row.FindAllStringSubmatch(string(mustRead(t, testbed.MustRepoPath(t, doc))), -1) {
			l := literal.FindStringSubmatch(m[2])
			if l == nil {
				continue // a default that depends on other keys, or none
			}
			for _, key := range expandPool(m[1]) {
				got, ok := appliedAt(applied, strings.Split(key, "."))
				if !ok {
					continue
				}
				want := l[1]
				if other, ok := appliedAt(applied, strings.Split(want, ".")); ok && strings.Contains(want, ".") {
					want = fmt.Sprint(other) // another key's value
				}
				switch {
				case got == nil && !zero(want):
					later++ // left 0 in the file and applied where it is read (0 means the default)
				case !sameValue(got, want):
					t.Errorf("%s documents %s's default as %s; the service applies %v", doc, key, m[2], got)
				default:
					checked++
				}
			}
		}
	}
	if checked < 50 {
		t.Errorf("%d defaults checked: the tables' shape changed?", checked)
	}
	t.Logf("%d defaults checked, %d applied where they are read", checked, later)
}

// expandPool is key in each pool, when it is a pools.<pool> key.
func expandPool(key string) []string {
	if strings.Contains(key, "<pool>") {
		return []string{strings.Replace(key, "<pool>", "prefill", 1), strings.Replace(key, "<pool>", "decode", 1)}
	}
	return []string{key}
}

// appliedAt is the value at path in v, a JSON object; a key left out is its
// zero value (omitempty), reported as nil with ok when its parent exists.
func appliedAt(v map[string]any, path []string) (any, bool) {
	for i, p := range path {
		x, ok := v[p]
		if !ok {
			return nil, i == len(path)-1
		}
		if i == len(path)-1 {
			return x, true
		}
		if v, ok = x.(map[string]any); !ok {
			return nil, false
		}
	}
	return nil, false
}

// zero says whether a documented default is its type's zero value, which
// the parsed config leaves out.
func zero(want string) bool {
	if d, err := time.ParseDuration(want); err == nil {
		return d == 0
	}
	if f, err := strconv.ParseFloat(want, 64); err == nil {
		return f == 0
	}
	return want == "false" || want == `""` || want == "[]"
}

// sameValue says whether got, a value of the parsed config as JSON, is the
// documented want: durations and numbers by value, nil as want's zero.
func sameValue(got any, want string) bool {
	if got == nil {
		return zero(want)
	}
	if d, err := time.ParseDuration(want); err == nil {
		s, _ := got.(string)
		g, err := time.ParseDuration(s)
		return err == nil && g == d
	}
	if f, err := strconv.ParseFloat(want, 64); err == nil {
		g, _ := got.(float64)
		return g == f
	}
	return fmt.Sprint(got) == want
}
