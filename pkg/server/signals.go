package server

import (
	"context"
	"os"
	"syscall"
	"time"
)

// awaitStop returns once ctx is done or a stop signal arrives, or with the
// error of a listener that failed; a SIGHUP meanwhile reads the config file.
func (s *Server) awaitStop(ctx context.Context, errc <-chan error) (err error, failed bool) {
	for {
		select {
		case err = <-errc:
			return err, true
		case <-ctx.Done():
			return nil, false
		case sig := <-s.opts.Signals:
			if !s.hangUp(sig) {
				return nil, false
			}
		}
	}
}

// delay serves on for Options.ShutdownDelay, not ready: an Envoy that finds
// this server by its active health checks alone (outside Kubernetes) keeps
// opening streams to it until a check hears NOT_SERVING, and those would fail
// on a closed listener. A second SIGTERM or interrupt ends it, as an operator
// in a hurry expects.
func (s *Server) delay() {
	if s.opts.ShutdownDelay <= 0 {
		return
	}
	over := s.after(s.opts.ShutdownDelay)
	for {
		select {
		case <-over:
			return
		case sig := <-s.opts.Signals:
			if !s.hangUp(sig) {
				s.log.Info("a second signal: closing the listener without the rest of the shutdown delay", "signal", sig.String())
				return
			}
		}
	}
}

// graceOver waits Options.Grace for done, and says whether it is over
// first: the grace ran out or a stop signal came, which ends the process now,
// as a signal after the one that began the shutdown (and the one that ended
// its delay) is expected to.
func (s *Server) graceOver(done <-chan struct{}) bool {
	grace := time.NewTimer(s.opts.Grace)
	defer grace.Stop()
	for {
		select {
		case <-done:
			return false
		case <-grace.C:
			s.log.Info("grace period over; cutting the remaining streams and prefill legs")
			return true
		case sig := <-s.opts.Signals:
			if !s.hangUp(sig) {
				s.log.Info("another signal: cutting the remaining streams and prefill legs now", "signal", sig.String())
				return true
			}
		}
	}
}

// hangUp has the config file read now if sig is SIGHUP, which asks a daemon
// to reload its config (Go's default for it is to exit), and says whether it
// was.
func (s *Server) hangUp(sig os.Signal) bool {
	if sig != syscall.SIGHUP {
		return false
	}
	if s.opts.ConfigPath == "" {
		s.log.Info("SIGHUP: no --config file to read again; nothing changes")
		return true
	}
	s.log.Info("SIGHUP: reading the config file again", "path", s.opts.ConfigPath)
	select {
	case s.reread <- struct{}{}:
	default: // a read is already due
	}
	return true
}
