package main

import (
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"time"
)

// Flag values that would run, but not as the operator asked, are refused
// before anything starts.
func TestFlagsThatCannotRunAsAskedAreRefused(t *testing.T) {
	ok := flags{grace: 30 * time.Second, logFlush: time.Second}
	for _, tt := range []struct {
		name string
		set  func(*flags)
		want string // "" passes
	}{
		{"the defaults", func(*flags) {}, ""},
		{"no grace, no buffering", func(f *flags) { f.grace, f.logFlush = 0, 0 }, ""},
		{"a negative verbosity", func(f *flags) { f.verbosity = -1 }, "-v -1"},
		{"more detail than there is", func(f *flags) { f.verbosity = 3 }, ""},
		// zap's levels are an int8: -v 129 and up wrapped to a level above
		// fatal, and not even an error was logged.
		{"the most detail zap can take", func(f *flags) { f.verbosity = 128 }, ""},
		{"a verbosity past zap's levels", func(f *flags) { f.verbosity = 200 }, "-v 200"},
		{"a negative grace", func(f *flags) { f.grace = -time.Second }, "--shutdown-grace -1s"},
		{"a negative delay", func(f *flags) { f.delay = -time.Second }, "--shutdown-delay -1s"},
		{"a negative keepalive ping", func(f *flags) { f.keepalive.Ping = -time.Second }, "--keepalive-ping -1s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := ok
			tt.set(&f)
			err := f.validate()
			if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
				t.Errorf("validate() = %v, want %q", err, tt.want)
			}
		})
	}
}

// The console format colours its levels only on a terminal: written to a
// file or a pipe (make run > log) the lines carry no escape codes.
func TestConsoleLogsToAPipeHaveNoColourCodes(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = w
	log, flush, err := newLogger("console", 0, 0)
	os.Stderr = stderr
	if err != nil {
		t.Fatal(err)
	}
	log.Info("started")
	log.Error(errors.New("boom"), "failed")
	flush()
	w.Close()
	out, _ := io.ReadAll(r)
	if !strings.Contains(string(out), "INFO") || !strings.Contains(string(out), "ERROR") {
		t.Fatalf("log %q: want INFO and ERROR levels", out)
	}
	if strings.Contains(string(out), "\x1b[") {
		t.Errorf("log %q carries colour codes into a pipe", out)
	}
}
