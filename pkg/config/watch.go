package config

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"time"

	"github.com/fsnotify/fsnotify"
)

// watchReady is called once the watch is in place (tests wait for it).
var watchReady = func() {}

// settle is how long the directory must stay quiet before the file is re-read:
// editors and Kubernetes write a new file in several steps.
const settle = 100 * time.Millisecond

// Watch re-reads the file at path whenever its directory changes (and after
// the watch reports an error, which may have cost it events) and hands
// apply each valid file that differs from the last, as the process started
// with started runs it (inForce), with the keys of the file that wait for a
// restart. A file that fails to load or validate, or would be refused as it
// runs, goes to reject and the old config stays in force. The file is also read once as soon as the watch is in
// place, so that a change made between the caller's load and the watch is not
// lost, and again at each receive from reread (SIGHUP), when a file
// rejected before is rejected again. Watch returns when ctx is done, or at
// once with an error when the directory cannot be watched.
//
// The directory is watched, not the file, because the file is usually replaced
// rather than written: editors rename a temporary file over it, and a
// Kubernetes ConfigMap volume swaps its ..data symlink, so a watch on the file
// itself would follow the old inode and go silent. When the directory itself
// goes (a ConfigMap item in a subdirectory is conf -> ..data/conf, a directory
// of the copy each update deletes; a tool renames a new directory in place of
// the old), the watch is set again on what its path now leads to.
//
// When the directory exists but cannot be watched (inotify instances or
// watches run out: fs.inotify.max_user_instances is shared by every process
// of the user ID on a node, and containers of one image share one), or is
// gone, the file is read every pollEvery instead, and the watch tried again
// each time; the failure goes to reject, so it is counted and logged.
func Watch(ctx context.Context, path string, started *Config, reread <-chan struct{}, apply func(run *Config, pending []string), reject func(error)) error {
	d := &dirWatch{path: path}
	defer d.stop()
	switch err := d.start(); {
	case errors.Is(err, fs.ErrNotExist):
		return err
	case err != nil:
		reject(err)
	}
	watchReady()

	var last []byte
	file, run := started, started
	timer := time.NewTimer(0) // the first read, now that the watch is in place
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-events(d.w):
			if !ok {
				return nil
			}
			if ev.Name == filepath.Dir(path) && ev.Op&(fsnotify.Remove|fsnotify.Rename) != 0 {
				d.drop() // the directory went: its path may lead to a new one once the change settles
			}
			timer.Reset(settle)
		case err, ok := <-errs(d.w):
			if !ok {
				return nil
			}
			reject(fmt.Errorf("config: watching %s: %w", path, err))
			// Events may have been lost (inotify's queue overflowed): the
			// file is read again, or a change waits for the next event.
			timer.Reset(settle)
		case <-tickerC(d.poll):
			_ = d.start() // said when polling began
			timer.Reset(0)
		case <-reread:
			last = nil // answered even when unchanged: a rejected file is rejected again
			timer.Reset(0)
		case <-timer.C:
			if d.w == nil && d.poll == nil { // dropped: watch where the path now leads, before reading
				if err := d.start(); err != nil {
					reject(err)
				}
			}
			data, err := os.ReadFile(path)
			if err != nil {
				reject(fmt.Errorf("config: %w; keeping the running config", err))
				continue
			}
			if bytes.Equal(data, last) {
				continue // a touch, or a sibling file changed
			}
			last = data
			c, err := Parse(data)
			var next *Config
			var pending []string
			if err == nil {
				next, pending, err = c.reloadable(started, run)
			}
			if err != nil {
				reject(fmt.Errorf("%w; keeping the running config", err))
				continue
			}
			if reflect.DeepEqual(c, file) {
				continue // the same config, perhaps written differently
			}
			file, run = c, next
			apply(run, pending)
		}
	}
}

// pollEvery is how often the file is read while its directory cannot be
// watched.
var pollEvery = 10 * time.Second

// newWatcher is fsnotify's, or a test's.
var newWatcher = fsnotify.NewWatcher

// dirWatch watches path's directory, or, while it cannot, ticks every
// pollEvery for the file to be read and the watch tried again.
type dirWatch struct {
	path string
	w    *fsnotify.Watcher // nil while polling
	poll *time.Ticker      // nil while watching
}

// start (re)places the watch on the directory path now leads to; when it
// cannot, it polls, and says why.
func (d *dirWatch) start() error {
	d.drop()
	w, err := watchDir(d.path)
	if err != nil {
		if d.poll == nil {
			d.poll = time.NewTicker(pollEvery)
		}
		return fmt.Errorf("%w; reading the file every %s until it can be watched", err, pollEvery)
	}
	d.w = w
	if d.poll != nil {
		d.poll.Stop()
		d.poll = nil
	}
	return nil
}

// drop closes the watch, whose directory went.
func (d *dirWatch) drop() {
	if d.w != nil {
		d.w.Close()
		d.w = nil
	}
}

func (d *dirWatch) stop() {
	d.drop()
	if d.poll != nil {
		d.poll.Stop()
	}
}

// watchDir watches path's directory; nil on an error.
func watchDir(path string) (*fsnotify.Watcher, error) {
	w, err := newWatcher()
	if err == nil {
		if err = w.Add(filepath.Dir(path)); err == nil {
			return w, nil
		}
		w.Close()
	}
	return nil, fmt.Errorf("config: watching %s: %w", path, err)
}

// events, errs and tickerC are the channels of w and t, nil (never ready)
// for none.
func events(w *fsnotify.Watcher) chan fsnotify.Event {
	if w == nil {
		return nil
	}
	return w.Events
}

func errs(w *fsnotify.Watcher) chan error {
	if w == nil {
		return nil
	}
	return w.Errors
}

func tickerC(t *time.Ticker) <-chan time.Time {
	if t == nil {
		return nil
	}
	return t.C
}
