package config

import "fmt"

// Envoy tunes how we talk to Envoy.
type Envoy struct {
	OverrideAfter          Duration `json:"override_after"`
	OverrideMessageTimeout Duration `json:"override_message_timeout"`
}

// ShortOverride says, when it is so, that envoy.override_message_timeout is
// below what routing a request may take: prefill.timeout, and admission.hold
// where requests may be held. In BUFFERED processing Envoy's message timer
// runs meanwhile, and the override is all the time it then gives. Only
// Envoy knows its processing mode (FULL_DUPLEX_STREAMED has no such timer),
// so this is a warning, not an error. At a reload c is the config in force
// (inForce), whose envoy.* and prefill.* are still those of the start.
func (c *Config) ShortOverride() string {
	routing, what := c.Prefill.Timeout, fmt.Sprintf("prefill.timeout %s", c.Prefill.Timeout.D())
	if held := c.Admission.Held(); held > 0 {
		routing += held
		what += fmt.Sprintf(" + admission.hold %s", held.D())
	}
	if c.Envoy.OverrideMessageTimeout >= routing {
		return ""
	}
	return fmt.Sprintf("envoy.override_message_timeout %s is below %s: in BUFFERED processing Envoy answers 504 "+
		"before the prefill leg may end; raise it (and Envoy's max_message_timeout), or lower prefill.timeout", c.Envoy.OverrideMessageTimeout.D(), what)
}
