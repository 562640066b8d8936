package config

import (
	"io/fs"
	"os"
	"strconv"
	"strings"
)

// MemoryPerBodyByte is what one byte of buffered request body costs the
// process, as benchmarked (docs/benchmarks.md, T4): peak RSS per in-flight
// request was 2.2–4.8 × its body decode-only and 2.0–4.2 × under P/D in
// FULL_DUPLEX, where bodies dominate memory; the echo floor alone reached 8 ×
// at small bodies, from Go's heap slack. 4 covers the measured FULL_DUPLEX
// cells; BUFFERED P/D (up to 7.8 ×) and small bodies are what GOMEMLIMIT is
// for.
const MemoryPerBodyByte = 4

// defaultMemory is what the bodies' share is taken from when no container
// limit is found.
const defaultMemory = 4 << 30

// cgroupFS is where the container's memory limit is read; a variable for tests.
var cgroupFS fs.FS = os.DirFS("/sys/fs/cgroup")

// DefaultMaxBufferedBytes is limits.max_buffered_bytes when the file leaves it
// out: the container's memory limit (cgroup v2 memory.max, or v1
// memory.limit_in_bytes), else 4 GiB, divided by MemoryPerBodyByte.
func DefaultMaxBufferedBytes(cgroup fs.FS) int64 {
	limit := memoryLimit(cgroup)
	if limit <= 0 {
		limit = defaultMemory
	}
	return limit / MemoryPerBodyByte
}

// GoMemoryLimit is the soft memory limit for Go's collector when GOMEMLIMIT
// is not set: 90 % of the container's memory limit, so that the collector
// works harder before the kernel kills the process, whatever the limit the
// pod was given; 0 (leave the runtime's) when the container has none.
func GoMemoryLimit() int64 {
	return memoryLimit(cgroupFS) / 10 * 9
}

// memoryLimit reads the cgroup's memory limit in bytes; 0 when there is none
// (no file, "max", or v1's "unlimited", a number near 2^63).
func memoryLimit(cgroup fs.FS) int64 {
	for _, name := range []string{"memory.max", "memory/memory.limit_in_bytes"} {
		b, err := fs.ReadFile(cgroup, name)
		if err != nil {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || n <= 0 || n >= 1<<60 {
			return 0
		}
		return n
	}
	return 0
}
