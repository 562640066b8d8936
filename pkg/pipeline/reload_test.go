package pipeline_test

import (
	"context"
	"testing"

	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
	"github.com/pd-extproc/pd-extproc/pkg/scheduling"

	"github.com/pd-extproc/pd-extproc/pkg/metrics"
)

// A reload that names another connector changes nothing about the legs until
// a restart, so scheduling must keep deciding for the running one: under
// kv-nixl a request with n > 1 stays decode-only even when the reloaded spec
// says the legs are paired (as kv-sglang's would).
func TestReloadKeepsTheRunningConnectorsPairing(t *testing.T) {
	p := newNIXL(t, "127.0.0.1:1", "{}")
	p.Reload(scheduling.Spec{
		Prefill: scheduling.PoolSpec{Endpoints: []string{"127.0.0.1:1"}},
		Decode:  scheduling.PoolSpec{Endpoints: []string{"10.1.1.1:8000"}},
		Paired:  true,
	})

	r := &pipeline.Request{ContentType: "application/json", Method: "POST", Path: "/v1/completions", RequestID: "r1", Body: []byte(`{"model":"m","prompt":"hi","n":2}`)}
	d, err := p.Route(context.Background(), r)
	if err != nil {
		t.Fatal(err)
	}
	d.Release()
	if r.Report.Mode != metrics.ModeDecodeOnly || r.Report.Reason != metrics.ReasonNGT1 || r.Report.Prefill != "" {
		t.Errorf("after the reload: mode %q, reason %q, prefill %q; want decode_only, %s and no prefill leg",
			r.Report.Mode, r.Report.Reason, r.Report.Prefill, metrics.ReasonNGT1)
	}
}
