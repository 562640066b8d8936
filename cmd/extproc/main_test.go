package main

import (
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
