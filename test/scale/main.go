// Command scale holds thousands of streaming generations open at once
// through the Envoy emulator and two ext_proc replicas, and measures what each
// held stream costs the replicas, beside the echo ext_proc server of bench/
// held the same way in the same run.
//
//	make soak-scale                               # 10,000 streams, every mode
//	go run ./test/scale -bin bin -streams 2000    # a smaller run
//
// One run per target and response mode. A target is extproc doing P/D
// (kv-nixl, two pdsim prefill engines), extproc decode-only, or bench/echo.
// The response path goes through the ext_proc server ("on",
// config/envoy/envoy.yaml as shipped: FULL_DUPLEX both ways) or not ("off":
// the same file with the response path skipped, so Envoy closes the ext_proc
// stream once the request is routed). Each run starts its own processes:
// two decode engines (pdsim streaming one token every -tpot), the two ext_proc
// replicas, and -emulators Envoy emulators, each a child process of this
// driver (a process here may hold only so many files, and every stream costs
// the emulator two connections). The driver opens -streams streaming chat
// requests over -ramp, spread over the emulators, waits until every one is
// streaming, measures the replicas while all are held, then lets them finish.
//
// The report (Markdown, also to -out) gives per run: requests completed,
// failed and lost; the replicas' resident memory, live heap and goroutines
// above idle per held stream; their CPU while holding; Envoy's overflow
// counters; and, with -pprof-dir, what dominates a heap profile taken while
// holding. Files: stack.go starts a run's processes, emulator.go is the
// emulator child, load.go the streams, measure.go the figures, report.go the
// tables.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

type options struct {
	bin, targets, responses, out, pprofDir, logDir string
	streams, emulators, tokens, bodyBytes          int
	ramp, tpot, minHold                            time.Duration
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == childEmulator {
		if err := runEmulator(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "emulator:", err)
			os.Exit(1)
		}
		return
	}
	var o options
	flag.StringVar(&o.bin, "bin", "bin", "directory holding extproc, pdsim and echo (make soak-scale builds them)")
	flag.StringVar(&o.targets, "targets", "pd,decode,echo", "ext_proc servers: pd (extproc P/D), decode (extproc decode-only), echo (bench/echo)")
	flag.StringVar(&o.responses, "responses", "on,off", "response path through the ext_proc server: on, off")
	flag.IntVar(&o.streams, "streams", 10000, "streaming requests held at once")
	flag.IntVar(&o.emulators, "emulators", 2, "Envoy emulator processes the streams are spread over")
	flag.DurationVar(&o.ramp, "ramp", 25*time.Second, "time over which the streams are opened")
	flag.DurationVar(&o.tpot, "tpot", 5*time.Second, "time between the tokens of a stream")
	flag.IntVar(&o.tokens, "tokens", 19, "tokens per stream (a stream lasts about tokens × tpot)")
	flag.DurationVar(&o.minHold, "min-hold", 60*time.Second, "the run fails unless every stream was held at once this long")
	flag.IntVar(&o.bodyBytes, "body-bytes", 3700, "request body size")
	flag.StringVar(&o.out, "out", "", "also write the report to this file")
	flag.StringVar(&o.pprofDir, "pprof-dir", "", "save a heap profile of each ext_proc server while holding, and summarize it")
	flag.StringVar(&o.logDir, "logs", "", "directory for the children's logs (default: a new temporary directory)")
	flag.Parse()
	testbed.Main("scale", func(ctx context.Context) error { return run(ctx, o) })
}

func run(ctx context.Context, o options) error {
	if gen := time.Duration(o.tokens) * o.tpot; gen-o.ramp < o.minHold {
		return fmt.Errorf("streams of %d × %v opened over %v are all held for at most %v, below -min-hold %v",
			o.tokens, o.tpot, o.ramp, gen-o.ramp, o.minHold)
	}
	files, err := raiseFileLimit()
	if err != nil {
		return err
	}
	if need := uint64(o.streams + 512); files < need {
		return fmt.Errorf("this process may open %d files; %d streams need about %d", files, o.streams, need)
	}
	if o.logDir == "" {
		if o.logDir, err = os.MkdirTemp("", "pd-scale-"); err != nil {
			return err
		}
	}
	for _, dir := range []string{o.logDir, o.pprofDir} {
		if dir != "" {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
		}
	}
	rep := newReport(o, files)
	fmt.Fprintln(os.Stderr, rep.header())
	var errs []error
	for _, resp := range splitList(o.responses) {
		for _, target := range splitList(o.targets) {
			fmt.Fprintf(os.Stderr, "== %s, response path %s: %d streams\n", target, resp, o.streams)
			res, err := runOne(ctx, o, target, resp)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s/%s: %w", target, resp, err))
			}
			rep.add(res)
			fmt.Fprintln(os.Stderr, res.summary())
			if ctx.Err() != nil {
				return errors.Join(append(errs, ctx.Err())...)
			}
		}
	}
	text := rep.String()
	fmt.Println(text)
	if o.out != "" {
		if err := os.WriteFile(o.out, []byte(text), 0o644); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(append(errs, rep.failures()...)...)
}

// raiseFileLimit lifts this process's soft limit on open files to the hard
// one (Go does so at start since 1.19; the check says what there is to work
// with) and returns the limit.
func raiseFileLimit() (uint64, error) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, err
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			return 0, err
		}
	}
	return lim.Cur, nil
}
