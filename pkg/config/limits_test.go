package config

import (
	"testing"
	"testing/fstest"
	"time"
)

// Without limits.max_buffered_bytes the bodies may take a quarter of the
// container's memory limit, read as cgroup v2 or v1 write it; 4 GiB is assumed
// when there is none.
func TestDefaultMaxBufferedBytesFollowsTheContainer(t *testing.T) {
	const gib = 1 << 30
	tests := []struct {
		name  string
		files fstest.MapFS
		want  int64
	}{
		{"cgroup v2 limit", fstest.MapFS{"memory.max": {Data: []byte("1073741824\n")}}, gib / 4},
		{"cgroup v2 without a limit", fstest.MapFS{"memory.max": {Data: []byte("max\n")}}, gib},
		{"cgroup v1 limit", fstest.MapFS{"memory/memory.limit_in_bytes": {Data: []byte("2147483648\n")}}, gib / 2},
		{"cgroup v1 without a limit", fstest.MapFS{"memory/memory.limit_in_bytes": {Data: []byte("9223372036854771712\n")}}, gib},
		{"no cgroup files", fstest.MapFS{}, gib},
		{"garbage", fstest.MapFS{"memory.max": {Data: []byte("lots")}}, gib},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := DefaultMaxBufferedBytes(tt.files); got != tt.want {
				t.Errorf("DefaultMaxBufferedBytes = %d, want %d", got, tt.want)
			}
		})
	}
}

// The file's own values win; an automatic one never falls below one body of
// the largest size.
func TestBodyLimitsDefaults(t *testing.T) {
	saved := cgroupFS
	t.Cleanup(func() { cgroupFS = saved })
	cgroupFS = fstest.MapFS{"memory.max": {Data: []byte("67108864")}} // 64 MiB: 16 MiB of bodies
	tests := []struct {
		name, limits string
		wantBuffered int64
		wantTimeout  time.Duration
	}{
		{"defaults: the larger of a quarter of memory and one body", `{}`, 32 << 20, 60 * time.Second},
		{"a small max_body_bytes", `{max_body_bytes: 1048576}`, 16 << 20, 60 * time.Second},
		{"set in the file", `{max_buffered_bytes: 123456789, body_timeout: 5s}`, 123456789, 5 * time.Second},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(`{connector: kv-nixl, limits: ` + tt.limits + `, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}}`))
			if err != nil {
				t.Fatal(err)
			}
			if c.Limits.MaxBufferedBytes != tt.wantBuffered || c.Limits.BodyTimeout.D() != tt.wantTimeout {
				t.Errorf("max_buffered_bytes %d, body_timeout %v; want %d, %v", c.Limits.MaxBufferedBytes, c.Limits.BodyTimeout.D(), tt.wantBuffered, tt.wantTimeout)
			}
		})
	}
}

// Background legs are capped by default at the stream cap; each prefill engine
// gets at most DefaultMaxConnsPerEndpoint connections.
func TestPrefillCapsDefaults(t *testing.T) {
	const decode = `connector: kv-nixl, pools: {decode: {endpoints: ["10.0.0.2:8000"]}}`
	tests := []struct {
		keys                  string
		wantBackground, conns int
	}{
		{``, DefaultMaxConcurrentStreams, DefaultMaxConnsPerEndpoint},
		{`limits: {max_concurrent_streams: 7}, `, 7, DefaultMaxConnsPerEndpoint},
		{`limits: {max_concurrent_streams: 7}, prefill: {max_background: 3, max_conns_per_endpoint: 9}, `, 3, 9},
	}
	for _, tt := range tests {
		c, err := Parse([]byte(`{` + tt.keys + decode + `}`))
		if err != nil {
			t.Fatal(err)
		}
		if c.Prefill.MaxBackground != tt.wantBackground || c.Prefill.MaxConnsPerEndpoint != tt.conns {
			t.Errorf("%q: max_background %d, max_conns_per_endpoint %d; want %d, %d", tt.keys,
				c.Prefill.MaxBackground, c.Prefill.MaxConnsPerEndpoint, tt.wantBackground, tt.conns)
		}
	}
}

// Without GOMEMLIMIT, Go's collector is given 90 % of the container's memory
// limit, whatever limit the pod has; none without a limit.
func TestGoMemoryLimitFollowsTheContainer(t *testing.T) {
	saved := cgroupFS
	t.Cleanup(func() { cgroupFS = saved })
	for _, tt := range []struct {
		files fstest.MapFS
		want  int64
	}{
		{fstest.MapFS{"memory.max": {Data: []byte("1073741824\n")}}, 1073741824 / 10 * 9},
		{fstest.MapFS{"memory/memory.limit_in_bytes": {Data: []byte("536870912\n")}}, 536870912 / 10 * 9},
		{fstest.MapFS{"memory.max": {Data: []byte("max\n")}}, 0},
		{fstest.MapFS{}, 0},
	} {
		cgroupFS = tt.files
		if got := GoMemoryLimit(); got != tt.want {
			t.Errorf("GoMemoryLimit() with %v = %d, want %d", tt.files, got, tt.want)
		}
	}
}
