package pdsim

import (
	"context"
	"net/http"
	"testing"
	"time"
)

func TestFaultInjection(t *testing.T) {
	tests := []struct {
		name   string
		faults Faults
		want   []int // status per request; -1: connection dropped
	}{
		{"every 2nd fails", Faults{FailStatus: 503, FailEvery: 2}, []int{200, 503, 200, 503}},
		{"all fail", Faults{FailStatus: 429, FailEvery: 1}, []int{429, 429}},
		{"FailEvery 0 means all", Faults{FailStatus: 500}, []int{500}},
		{"every 3rd dropped", Faults{DropConnections: true, FailEvery: 3}, []int{200, 200, -1}},
		{"delay only", Faults{Delay: 20 * time.Millisecond}, []int{200}},
		{"none", Faults{}, []int{200, 200}},
	}
	s := start(t, Config{Role: RoleDecode, Protocol: ProtocolNIXL})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s.SetFaults(tt.faults)
			before := len(s.Requests())
			for i, want := range tt.want {
				began := time.Now()
				r, err := do(context.Background(), s, "/v1/completions", `{"prompt":"x"}`, "")
				got := r.status
				if err != nil {
					got = -1
				}
				if got != want {
					t.Fatalf("request %d: status %d (%v), want %d", i, got, err, want)
				}
				if time.Since(began) < tt.faults.Delay {
					t.Errorf("answered in %s, before the %s delay", time.Since(began), tt.faults.Delay)
				}
				if want >= 400 && r.json(t)["error"].(map[string]any)["code"] != float64(want) {
					t.Errorf("error body %s", r.body)
				}
			}
			recs := s.Requests()[before:]
			for i, want := range tt.want {
				if want == -1 {
					want = 0
				}
				if recs[i].Status != want {
					t.Errorf("record %d status %d, want %d", i, recs[i].Status, want)
				}
			}
		})
	}
	s.SetFaults(Faults{})
	if r := get(t, s, "/health"); r.status != http.StatusOK {
		t.Errorf("health %d", r.status)
	}
}

func TestConfigFaultsApplyFromStart(t *testing.T) {
	s := start(t, Config{Role: RolePrefill, Protocol: ProtocolSharedStorage, SharedDir: t.TempDir(), FailStatus: 502})
	if r := post(t, s, "/v1/completions", `{"prompt":"x"}`, ""); r.status != 502 {
		t.Errorf("status %d", r.status)
	}
}
