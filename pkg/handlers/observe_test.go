package handlers_test

import (
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/go-logr/logr"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/envoymsg"
	"github.com/pd-extproc/pd-extproc/pkg/api"
	"github.com/pd-extproc/pd-extproc/pkg/handlers"
	"github.com/pd-extproc/pd-extproc/pkg/metrics"
	"github.com/pd-extproc/pd-extproc/pkg/pipeline"
)

// decisions is the sum of pd_decisions_total over its reasons.
func decisions(m *metrics.Metrics) (n float64) {
	for _, r := range metrics.Reasons() {
		v, _ := m.Sample("pd_extproc_pd_decisions_total", map[string]string{"reason": r})
		n += v
	}
	return n
}

// sender is where an exchange sends its replies.
type sender interface {
	Send(*extprocv3.ProcessingResponse) error
}

// A decision is counted when Envoy is told it: one whose routing reply broke
// on its way (the client left just then) reached no engine, and its request
// is counted cancelled.
func TestADecisionIsCountedOnlyOnceSent(t *testing.T) {
	tests := []struct {
		name          string
		sink          func() sender
		wantDecisions float64
		wantOutcome   string
	}{
		{"sent", func() sender { return &routedSink{} }, 1, metrics.OutcomeRouted},
		{"never sent", func() sender { return &brokenAtRouting{arrived: func() {}} }, 0, metrics.OutcomeCancelled},
	}
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{fullDuplex, buffered} {
		for _, tt := range tests {
			t.Run(mode.String()+"/"+tt.name, func(t *testing.T) {
				m := metrics.New("kv-nixl")
				p := newPipeline(t, `{connector: kv-nixl, pools: {decode: {endpoints: ["10.1.1.1:8000"]}}}`, pipeline.WithMetrics(m))
				s := handlers.NewServer(p, handlers.Options{Metrics: m}, logr.Discard())
				x := s.Open(t.Context(), tt.sink())
				for _, msg := range []*extprocv3.ProcessingRequest{
					envoymsg.WithModes(envoymsg.Headers(envoymsg.Request, false, envoymsg.Post(chatPath, len(clientChat))...), mode, fullDuplex),
					envoymsg.Body(envoymsg.Request, []byte(clientChat), true),
				} {
					if _, err := x.Handle(msg); err != nil {
						break
					}
				}
				x.Close()
				if got := decisions(m); got != tt.wantDecisions {
					t.Errorf("pd_decisions_total = %v, want %v", got, tt.wantDecisions)
				}
				labels := map[string]string{"api": api.NameChat, "mode": metrics.ModeDecodeOnly.String(), "connector": "kv-nixl", "outcome": tt.wantOutcome}
				if got, _ := m.Sample("pd_extproc_requests_total", labels); got != 1 {
					t.Errorf("requests_total%v = %v, want 1", labels, got)
				}
			})
		}
	}
}
