package metrics

import dto "github.com/prometheus/client_model/go"

// Sample reads one series from the registry, as a test in process reads what
// a scrape would show: the value of the series of name with exactly labels (a
// label it does not name must be empty; a histogram gives its sample count);
// false when there is none.
func (m *Metrics) Sample(name string, labels map[string]string) (float64, bool) {
	families, err := m.registry.Gather()
	if err != nil {
		return 0, false
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	next:
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue next
				}
			}
			switch f.GetType() {
			case dto.MetricType_HISTOGRAM:
				return float64(s.GetHistogram().GetSampleCount()), true
			case dto.MetricType_GAUGE:
				return s.GetGauge().GetValue(), true
			default:
				return s.GetCounter().GetValue(), true
			}
		}
	}
	return 0, false
}
