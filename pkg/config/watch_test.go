package config

import (
	"cmp"
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
	"go.uber.org/goleak"
)

const (
	validA = "connector: kv-nixl\npools: {decode: {endpoints: [\"10.0.0.2:8000\"]}}\n"
	validB = "connector: kv-nixl\npools: {decode: {endpoints: [\"10.0.0.3:8000\"]}}\n"
	broken = "connector: kv-nixl\npools: {decode: {endpoints: [\"not-an-address\"]}}\n"
)

// watching runs Watch on path, with the caller running the config in the
// file now, and returns channels of what it applied (the config in force)
// and rejected.
func watching(t *testing.T, path string) (applied chan *Config, rejected chan error) {
	t.Helper()
	running, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return watchingFrom(t, path, running)
}

// watchingFrom is watching, the process running with running.
func watchingFrom(t *testing.T, path string, running *Config) (applied chan *Config, rejected chan error) {
	t.Helper()
	return watchingWith(t, path, running, nil)
}

// watchingWith is watchingFrom, asked to read the file again by reread.
func watchingWith(t *testing.T, path string, running *Config, reread <-chan struct{}) (applied chan *Config, rejected chan error) {
	t.Helper()
	t.Cleanup(func() { goleak.VerifyNone(t) }) // runs last
	applied, rejected = make(chan *Config, 10), make(chan error, 10)
	ready := make(chan struct{})
	watchReady = func() { close(ready) }
	t.Cleanup(func() { watchReady = func() {} })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, path, running, reread, func(run *Config, _ []string) { applied <- run }, func(err error) { rejected <- err })
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Watch() = %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Watch did not return after cancel")
		}
	})
	select {
	case <-ready:
	case <-time.After(5 * time.Second):
		t.Fatal("the watch did not start within 5s")
	}
	return applied, rejected
}

func decodeEndpoint(t *testing.T, applied chan *Config) string {
	t.Helper()
	select {
	case c := <-applied:
		return c.Pools.Decode.Endpoints[0]
	case <-time.After(5 * time.Second):
		t.Fatal("no config applied within 5s")
		return ""
	}
}

func nothingApplied(t *testing.T, applied chan *Config) {
	t.Helper()
	select {
	case c := <-applied:
		t.Fatalf("applied %v, want nothing", c.Pools.Decode.Endpoints)
	case <-time.After(3 * settle):
	}
}

// rejectedSaying waits for a rejection that says each of wants, and then
// checks that nothing was applied. A file written in place can be read half
// written when the writer stalls past settle (a loaded machine): that read
// is rejected too, and the write's end is read after it.
func rejectedSaying(t *testing.T, rejected chan error, applied chan *Config, wants ...string) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	var seen []error
	for {
		select {
		case err := <-rejected:
			if saysAll(err, wants) {
				nothingApplied(t, applied)
				return
			}
			seen = append(seen, err)
		case <-deadline:
			t.Fatalf("no rejection saying %q within 5s; rejections: %v", wants, seen)
		}
	}
}

func saysAll(err error, wants []string) bool {
	for _, w := range wants {
		if !strings.Contains(err.Error(), w) {
			return false
		}
	}
	return true
}

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestWatchInPlaceWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "extproc.yaml")
	write(t, path, validA)
	applied, rejected := watching(t, path)

	write(t, path, validA) // same bytes: nothing to do
	nothingApplied(t, applied)
	write(t, path, "# the same config, written differently\n"+validA)
	nothingApplied(t, applied)

	write(t, path, validB)
	if got := decodeEndpoint(t, applied); got != "10.0.0.3:8000" {
		t.Fatalf("applied decode endpoint %s, want the new one", got)
	}

	write(t, path, broken)
	rejectedSaying(t, rejected, applied, "pools.decode.endpoints[0]", "keeping the running config")

	write(t, path, validA) // fixed: applied again
	if got := decodeEndpoint(t, applied); got != "10.0.0.2:8000" {
		t.Fatalf("applied decode endpoint %s after the fix", got)
	}
}

func TestWatchAtomicRename(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "extproc.yaml")
	write(t, path, validA)
	applied, _ := watching(t, path)

	tmp := filepath.Join(dir, ".extproc.yaml.tmp")
	write(t, tmp, validB)
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	if got := decodeEndpoint(t, applied); got != "10.0.0.3:8000" {
		t.Fatalf("applied %s after a rename over the file", got)
	}
	write(t, path, validA) // the watch still follows the new inode
	if got := decodeEndpoint(t, applied); got != "10.0.0.2:8000" {
		t.Fatalf("applied %s after a write to the renamed file", got)
	}
}

// A Kubernetes ConfigMap volume: extproc.yaml -> ..data/extproc.yaml,
// ..data -> ..<timestamp>; an update swaps ..data with a rename.
func TestWatchConfigMapSymlinkSwap(t *testing.T) {
	dir := t.TempDir()
	version := func(name, data string) {
		if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
			t.Fatal(err)
		}
		write(t, filepath.Join(dir, name, "extproc.yaml"), data)
	}
	version("..v1", validA)
	if err := os.Symlink("..v1", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "extproc.yaml")
	if err := os.Symlink(filepath.Join("..data", "extproc.yaml"), path); err != nil {
		t.Fatal(err)
	}
	applied, _ := watching(t, path)

	version("..v2", validB)
	if err := os.Symlink("..v2", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(filepath.Join(dir, "..v1"))
	if got := decodeEndpoint(t, applied); got != "10.0.0.3:8000" {
		t.Fatalf("applied %s after the ConfigMap swap", got)
	}
}

func TestWatchMissingDirectory(t *testing.T) {
	err := Watch(context.Background(), filepath.Join(t.TempDir(), "nope", "extproc.yaml"), &Config{}, nil, func(*Config, []string) {}, func(error) {})
	if err == nil {
		t.Fatal("Watch() on a missing directory = nil, want an error")
	}
}

// A change written after the caller loaded the file but before the watch was
// in place (extproc announces itself in between) is applied, not lost.
func TestWatchAppliesAChangeMadeBeforeTheWatchStarted(t *testing.T) {
	path := filepath.Join(t.TempDir(), "extproc.yaml")
	write(t, path, validA)
	running, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	write(t, path, validB)
	applied := make(chan *Config, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, path, running, nil, func(run *Config, _ []string) { applied <- run }, func(error) {})
	}()
	if got := decodeEndpoint(t, applied); got != "10.0.0.3:8000" {
		t.Fatalf("applied %s, want the change made before the watch", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A reload is checked against the running config, and a refused one leaves
// it running: the connector takes effect on restart, so a running kv-sglang
// must not take pd.mode never because the file now names kv-nixl; the removed
// pd.sglang_parallel_sampling: rooms is refused, saying why; so is a file
// without a connector.
// A reload is checked against the connector the process runs, not the one
// an earlier reload named (which waits for a restart): a kv-sglang process
// whose file turned to kv-nixl still refuses pd.mode never.
func TestWatchChecksReloadsAgainstTheConnectorRunning(t *testing.T) {
	const sglang = "connector: kv-sglang\npools: {prefill: {endpoints: [\"10.0.0.1:8000\"], bootstrap_port: 8998}, decode: {endpoints: [\"10.0.0.2:8000\"]}}\n"
	path := filepath.Join(t.TempDir(), "extproc.yaml")
	write(t, path, sglang)
	applied, rejected := watching(t, path)
	nixl := strings.Replace(sglang, "kv-sglang", "kv-nixl", 1)
	write(t, path, nixl)
	select {
	case c := <-applied:
		if c.Connector != "kv-sglang" {
			t.Fatalf("applied connector %s, want the running kv-sglang (the file's waits for a restart)", c.Connector)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the file naming another connector was not applied (for a restart) within 5s")
	}
	write(t, path, nixl+"pd: {mode: never}\n")
	rejectedSaying(t, rejected, applied, "running connector", "kv-sglang", "pd.mode")
}

func TestWatchRefusesAReload(t *testing.T) {
	const sglang = "connector: kv-sglang\npools: {prefill: {endpoints: [\"10.0.0.1:8000\"], bootstrap_port: 8998}, decode: {endpoints: [\"10.0.0.2:8000\"]}}\n"
	// Prefill engines found through Kubernetes, whose discovery a reload
	// does not stop (pools.prefill.kubernetes takes a restart), and shedding.
	const kube = "connector: kv-nixl\nadmission: {objectives: {batch: -1}}\n" +
		"pools: {prefill: {kubernetes: {selector: app=vllm, port: 8000}, metrics: {interval: 1s}}, decode: {endpoints: [\"10.0.0.2:8000\"], metrics: {interval: 1s}}}\n"
	const nixl = "connector: kv-nixl\npools: {prefill: {endpoints: [\"10.0.0.1:8000\"]}, decode: {endpoints: [\"10.0.0.2:8000\"]}}\n"
	tests := []struct {
		name   string
		start  string // "": sglang
		reload string
		wants  []string
	}{
		{"pd.mode never under a running kv-sglang", "", strings.Replace(sglang, "kv-sglang", "kv-nixl", 1) + "pd: {mode: never}\n",
			[]string{"running connector", "kv-sglang", "pd.mode"}},
		{"the removed rooms", "", sglang + "pd: {sglang_parallel_sampling: rooms}\n", []string{"rooms was removed", "never read"}},
		{"no connector", "", strings.TrimPrefix(sglang, "connector: kv-sglang\n"), []string{"connector: not set", "kv-nixl", "kv-shared-storage", "kv-sglang"}},
		{"built-in tools paired under kv-nixl", nixl, nixl + "routes: {pair_builtin_tools: true}\n",
			[]string{"routes.pair_builtin_tools", "kv-nixl", "keeping the running config"}},
		{"shedding without the scrapes of a pool whose kubernetes key is dropped", kube,
			"connector: kv-nixl\nadmission: {objectives: {batch: -1}}\npools: {decode: {endpoints: [\"10.0.0.2:8000\"], metrics: {interval: 1s}}}\n",
			[]string{"running", "pools.prefill.kubernetes", "set pools.prefill.metrics.interval"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "extproc.yaml")
			write(t, path, cmp.Or(tt.start, sglang))
			applied, rejected := watching(t, path)
			write(t, path, tt.reload)
			rejectedSaying(t, rejected, applied, tt.wants...)
		})
	}
}

// A directory that cannot be watched (inotify instances run out: they are
// shared by every process of the user ID on a node) is no reason to stop
// reloading: the failure is rejected, so it is counted and logged, the file
// is read every pollEvery, and the watch is tried again each time.
func TestWatchPollsWhileTheDirectoryCannotBeWatched(t *testing.T) {
	for _, recovers := range []bool{false, true} {
		t.Run(map[bool]string{false: "the watch never starts", true: "the watch starts later"}[recovers], func(t *testing.T) {
			failures := 1 << 30
			if recovers {
				failures = 1
			}
			pollEvery, newWatcher = 20*time.Millisecond, func() (*fsnotify.Watcher, error) {
				if failures > 0 {
					failures--
					return nil, syscall.EMFILE
				}
				return fsnotify.NewWatcher()
			}
			t.Cleanup(func() { pollEvery, newWatcher = 10*time.Second, fsnotify.NewWatcher })
			path := filepath.Join(t.TempDir(), "extproc.yaml")
			if err := os.WriteFile(path, []byte(validA), 0o600); err != nil {
				t.Fatal(err)
			}
			applied, rejected := watching(t, path)
			select {
			case err := <-rejected:
				if !strings.Contains(err.Error(), "too many open files") || !strings.Contains(err.Error(), "until it can be watched") {
					t.Errorf("rejected %v, want the watch's failure and the fallback", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("the watch's failure was not reported")
			}
			for _, want := range []string{"10.0.0.3:8000", "10.0.0.2:8000"} {
				if err := os.WriteFile(path, []byte(strings.ReplaceAll(validA, "10.0.0.2:8000", want)), 0o600); err != nil {
					t.Fatal(err)
				}
				if got := decodeEndpoint(t, applied); got != want {
					t.Fatalf("applied %s, want %s", got, want)
				}
			}
		})
	}
}

// keepWatcher has the watch keep its fsnotify watcher where the test can
// reach it (to drop its events, or send it an error): the func returns it
// once the watch has made it.
func keepWatcher(t *testing.T) func() *fsnotify.Watcher {
	var w *fsnotify.Watcher
	newWatcher = func() (*fsnotify.Watcher, error) {
		var err error
		w, err = fsnotify.NewWatcher()
		return w, err
	}
	t.Cleanup(func() { newWatcher = fsnotify.NewWatcher })
	return func() *fsnotify.Watcher { return w }
}

// A watch that fails (inotify's queue overflowed: its events were dropped)
// reads the file again: a change whose events were lost is applied, not left
// until the next change of the directory.
func TestWatchReadsTheFileAfterAWatchError(t *testing.T) {
	w := keepWatcher(t)
	dir := t.TempDir()
	path := filepath.Join(dir, "extproc.yaml")
	write(t, path, validA)
	running, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	// Written before the watch, read once it is in place: no event of it
	// can come later and read the file again.
	write(t, path, validB)
	applied, rejected := watchingFrom(t, path, running)
	if got := decodeEndpoint(t, applied); got != "10.0.0.3:8000" {
		t.Fatalf("applied %s, want 10.0.0.3:8000", got)
	}
	// The next change's events are lost: the directory is no longer
	// watched, and the watch says its queue overflowed.
	if err := w().Remove(dir); err != nil {
		t.Fatal(err)
	}
	write(t, path, validA)
	w().Errors <- fsnotify.ErrEventOverflow
	select {
	case err := <-rejected:
		if !strings.Contains(err.Error(), "queue or buffer overflow") {
			t.Errorf("rejected %v, want the watch's error", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the watch's error was not reported")
	}
	if got := decodeEndpoint(t, applied); got != "10.0.0.2:8000" {
		t.Fatalf("applied %s, want the change whose events were lost", got)
	}
}

// The watched directory itself can go away while its path stays: a
// ConfigMap item in a subdirectory (items: [{key: extproc.yaml, path:
// conf/extproc.yaml}]) is conf -> ..data/conf, a directory of the
// timestamped copy the kubelet deletes at each update, and a deployment
// tool may rename a new directory in place of the old one. Each update is
// applied, not only the first: the watch follows the path to the new
// directory.
func TestWatchFollowsAReplacedDirectory(t *testing.T) {
	tests := []struct {
		name string
		// setup writes data as the first version and returns the path to
		// watch and the function that writes each next version.
		setup func(t *testing.T, root, data string) (path string, update func(data string))
	}{
		{"a ConfigMap item in a subdirectory", func(t *testing.T, root, data string) (string, func(string)) {
			n := 0
			version := func(data string) string {
				n++
				name := "..v" + string(rune('0'+n))
				if err := os.MkdirAll(filepath.Join(root, name, "conf"), 0o755); err != nil {
					t.Fatal(err)
				}
				write(t, filepath.Join(root, name, "conf", "extproc.yaml"), data)
				return name
			}
			current := version(data)
			if err := os.Symlink(current, filepath.Join(root, "..data")); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(filepath.Join("..data", "conf"), filepath.Join(root, "conf")); err != nil {
				t.Fatal(err)
			}
			// As the kubelet's AtomicWriter: the new copy, ..data swapped by
			// a rename, the old copy removed.
			return filepath.Join(root, "conf", "extproc.yaml"), func(data string) {
				next := version(data)
				if err := os.Symlink(next, filepath.Join(root, "..data_tmp")); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(filepath.Join(root, "..data_tmp"), filepath.Join(root, "..data")); err != nil {
					t.Fatal(err)
				}
				if err := os.RemoveAll(filepath.Join(root, current)); err != nil {
					t.Fatal(err)
				}
				current = next
			}
		}},
		{"a new directory renamed in place of the old", func(t *testing.T, root, data string) (string, func(string)) {
			dir := filepath.Join(root, "conf")
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			write(t, filepath.Join(dir, "extproc.yaml"), data)
			return filepath.Join(dir, "extproc.yaml"), func(data string) {
				if err := os.Mkdir(dir+".new", 0o755); err != nil {
					t.Fatal(err)
				}
				write(t, filepath.Join(dir+".new", "extproc.yaml"), data)
				if err := os.Rename(dir, dir+".old"); err != nil {
					t.Fatal(err)
				}
				if err := os.Rename(dir+".new", dir); err != nil {
					t.Fatal(err)
				}
				if err := os.RemoveAll(dir + ".old"); err != nil {
					t.Fatal(err)
				}
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path, update := tt.setup(t, t.TempDir(), validA)
			applied, _ := watching(t, path)
			for i, want := range []string{"10.0.0.3:8000", "10.0.0.2:8000", "10.0.0.3:8000"} {
				update(strings.ReplaceAll(validA, "10.0.0.2:8000", want))
				select {
				case c := <-applied:
					if got := c.Pools.Decode.Endpoints[0]; got != want {
						t.Fatalf("update %d: applied %s, want %s", i+1, got, want)
					}
				case <-time.After(5 * time.Second):
					t.Fatalf("update %d: not applied within 5s", i+1)
				}
			}
		})
	}
}

// Asked to read the file again (SIGHUP), the watch reads it at once and
// answers: a change whose events were lost is applied, and a file it
// rejected before is rejected again, so each ask gets its log line.
func TestWatchRereadsWhenAsked(t *testing.T) {
	tests := []struct {
		name        string
		first, then string // the file the watch reads first, and once its events are lost ("": unchanged)
		wantApplied string // the decode endpoint applied once asked
		wantRejects string // or what the rejection says
	}{
		{name: "a change whose events were lost", first: validB, then: validA, wantApplied: "10.0.0.2:8000"},
		{name: "a file rejected before", first: broken, wantRejects: "not-an-address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := keepWatcher(t)
			dir := t.TempDir()
			path := filepath.Join(dir, "extproc.yaml")
			write(t, path, tt.first)
			running, err := Parse([]byte(validA))
			if err != nil {
				t.Fatal(err)
			}
			reread := make(chan struct{})
			applied, rejected := watchingWith(t, path, running, reread)
			if tt.wantRejects != "" { // the first read, once the watch is in place
				rejectedSaying(t, rejected, applied, tt.wantRejects)
			} else if got := decodeEndpoint(t, applied); got != "10.0.0.3:8000" {
				t.Fatalf("the first read applied %s, want 10.0.0.3:8000", got)
			}
			if err := w().Remove(dir); err != nil { // the directory's events are lost from now on
				t.Fatal(err)
			}
			if tt.then != "" {
				write(t, path, tt.then)
			}
			select {
			case reread <- struct{}{}:
			case <-time.After(5 * time.Second):
				t.Fatal("the watch does not take the ask to read again")
			}
			if tt.wantRejects != "" {
				rejectedSaying(t, rejected, applied, tt.wantRejects)
			} else if got := decodeEndpoint(t, applied); got != tt.wantApplied {
				t.Fatalf("asked to read again, applied %s, want %s", got, tt.wantApplied)
			}
		})
	}
}
