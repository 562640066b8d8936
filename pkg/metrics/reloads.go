package metrics

import "github.com/prometheus/client_golang/prometheus"

// Values of config_reloads_total{outcome}.
const (
	ReloadApplied  = "applied"  // the file's reloadable keys are in force
	ReloadRejected = "rejected" // it failed to load or validate: the previous config stays
)

// reloads counts the config file's changes, and the keys changed since start
// that wait for a restart: a rejected file, or one whose restart-only keys
// were never restarted onto, stays hidden until a pod restarts and runs it.
type reloads struct {
	outcomes *prometheus.CounterVec
	pending  prometheus.Gauge
}

func newReloads() reloads {
	return reloads{
		outcomes: counterVec("config_reloads_total",
			"Config file changes read, by outcome: applied (the reloadable keys are in force), rejected (it failed to load or validate; the previous config stays).",
			"outcome"),
		pending: gauge("config_restart_pending",
			"Keys of the config file changed since start that take effect only on a restart (0: the process runs what the file says)."),
	}
}

func (r reloads) collectors() []prometheus.Collector {
	return []prometheus.Collector{r.outcomes, r.pending}
}

func (r reloads) initSeries() {
	r.outcomes.WithLabelValues(ReloadApplied)
	r.outcomes.WithLabelValues(ReloadRejected)
}

// ConfigReloaded counts a config file applied, with the keys it changed
// since start that wait for a restart.
func (m *Metrics) ConfigReloaded(restartPending int) {
	if m != nil {
		m.reloads.outcomes.WithLabelValues(ReloadApplied).Inc()
		m.reloads.pending.Set(float64(restartPending))
	}
}

// ConfigRejected counts a config file that failed to load or validate.
func (m *Metrics) ConfigRejected() {
	if m != nil {
		m.reloads.outcomes.WithLabelValues(ReloadRejected).Inc()
	}
}
