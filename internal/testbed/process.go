package testbed

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ProcessConfig says how to run a child process and when it is ready.
type ProcessConfig struct {
	Name string // in errors
	Bin  string
	Args []string
	// Log receives the child's stdout and stderr. An *os.File is handed to
	// the child as it is, so no work of this process stands between the
	// child and its log (what a benchmark measures stays the child's); any
	// other writer gets one whole line, with its newline, per Write. Nil
	// discards the output.
	Log io.Writer
	// Ready is polled until it returns nil; nil: ready once started.
	Ready func(ctx context.Context) error
	// Timeout bounds the wait for Ready; default 30s.
	Timeout time.Duration
}

// ErrAddrInUse is what StartProcess's error wraps when the child exited
// before it was ready because an address it was given was taken.
var ErrAddrInUse = errors.New("address already in use")

// stopGrace is how long Stop lets a child end after SIGTERM before it kills it.
const stopGrace = 10 * time.Second

// Process is a running child process.
type Process struct {
	Name   string
	cmd    *exec.Cmd
	exited chan struct{} // closed once the child is gone and its output read
	head   *startupOutput
}

// StartProcess runs the child, waits until it is ready and hands its Stop to
// c. A child that exits or is not ready in time is stopped, and the error
// shows what it printed.
func StartProcess(ctx context.Context, c Cleaner, cfg ProcessConfig) (*Process, error) {
	p := &Process{Name: cfg.Name, cmd: exec.Command(cfg.Bin, cfg.Args...), exited: make(chan struct{}), head: &startupOutput{}}
	if p.Name == "" {
		p.Name = cfg.Bin
	}
	copied := make(chan struct{})
	var pipe *os.File // the write end, when the output is copied here
	if f, ok := cfg.Log.(*os.File); ok {
		p.head.file, p.head.offset = f, offset(f)
		p.cmd.Stdout, p.cmd.Stderr = f, f
		close(copied)
	} else {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		pipe = w
		p.cmd.Stdout, p.cmd.Stderr = w, w
		go func() {
			defer close(copied)
			copyLines(r, cfg.Log, p.head)
			r.Close()
		}()
	}
	err := p.cmd.Start()
	if pipe != nil {
		pipe.Close() // the child has its own copy: the pipe ends when the child does
	}
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", p.Name, err)
	}
	go func() {
		p.cmd.Wait()
		<-copied
		close(p.exited)
	}()
	if cfg.Ready != nil {
		if err := p.waitReady(ctx, cfg.Ready, cmp.Or(cfg.Timeout, 30*time.Second)); err != nil {
			p.Stop()
			return nil, err
		}
	}
	c.Cleanup(p.Stop)
	return p, nil
}

// waitReady polls ready, a server this process does not own, every 20 ms
// until it answers, the child exits, ctx ends or timeout passes.
func (p *Process) waitReady(ctx context.Context, ready func(context.Context) error, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-p.exited:
			err := fmt.Errorf("%s exited before it was ready (%v):\n%s", p.Name, p.cmd.ProcessState, p.Output())
			if strings.Contains(p.Output(), ErrAddrInUse.Error()) {
				err = fmt.Errorf("%w: %w", ErrAddrInUse, err)
			}
			return err
		case <-ctx.Done():
			return fmt.Errorf("%s not ready after %v: %v:\n%s", p.Name, timeout, err, p.Output())
		case <-tick.C:
		}
	}
}

// Pid is the child's process id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited is closed once the child has exited.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Stop asks the child to stop (SIGTERM) and waits for it; past a grace
// period it kills it. Stopping a child that is gone does nothing.
func (p *Process) Stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(stopGrace):
		p.Kill()
	}
}

// Signal sends the child sig, without waiting for it.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// ExitCode is the child's exit status once Exited is closed, -1 when a
// signal ended it.
func (p *Process) ExitCode() int { return p.cmd.ProcessState.ExitCode() }

// Kill ends the child at once (SIGKILL: no graceful drain) and waits for it.
func (p *Process) Kill() {
	p.cmd.Process.Kill()
	<-p.exited
}

// Output is the start of what the child printed (up to 64 KiB), for errors.
func (p *Process) Output() string { return p.head.String() }

// startupOutput keeps the first bytes a child printed: from the pipe as they
// are copied, or read back from the log file it writes itself.
type startupOutput struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	file   *os.File
	offset int64
}

const startupOutputMax = 64 << 10

func (o *startupOutput) Write(b []byte) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.buf.Write(b[:min(len(b), startupOutputMax-o.buf.Len())])
}

func (o *startupOutput) String() string {
	if o.file != nil {
		b := make([]byte, startupOutputMax)
		n, _ := o.file.ReadAt(b, o.offset)
		return string(b[:n])
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

func offset(f *os.File) int64 {
	off, _ := f.Seek(0, io.SeekCurrent)
	return off
}

// copyLines copies r to dst a whole line per Write until r ends, keeping the
// start in head.
func copyLines(r io.Reader, dst io.Writer, head *startupOutput) {
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			head.Write(line)
			if dst != nil {
				dst.Write(line)
			}
		}
		if err != nil {
			return
		}
	}
}

// WithFreshPorts calls start, which gives a child process or in-process
// servers free ports (FreeAddr), again while one lost the race for one of
// them (ErrAddrInUse, or a listener's EADDRINUSE), up to 5 times: other
// sockets, this process's own connections included, draw from the same
// range.
func WithFreshPorts[T any](start func() (T, error)) (T, error) {
	for attempt := 1; ; attempt++ {
		v, err := start()
		if err == nil || attempt == 5 || !errors.Is(err, ErrAddrInUse) && !errors.Is(err, syscall.EADDRINUSE) {
			return v, err
		}
	}
}

// LineFunc is a Log writer that hands each line to a function, without its
// newline. It expects a whole line per Write, as StartProcess and pdsim
// write them.
type LineFunc func(line string)

func (f LineFunc) Write(b []byte) (int, error) {
	f(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}
