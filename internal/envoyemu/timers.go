package envoyemu

import (
	"net/http"
	"time"
)

// loopTimer is a timer whose callback runs on the exchange's event loop. A
// fire already posted when the timer is stopped or re-armed is recognised by
// its generation and dropped, so stop is final even if the timer raced it.
type loopTimer struct {
	t   *time.Timer
	gen int
}

func (lt *loopTimer) start(x *exchange, d time.Duration, fn func()) {
	lt.stop()
	gen := lt.gen
	lt.t = time.AfterFunc(d, func() {
		x.post(func() {
			if gen != lt.gen || lt.t == nil {
				return // stale: stopped or re-armed since
			}
			lt.t = nil
			fn()
		})
	})
}

func (lt *loopTimer) stop() {
	if lt.t != nil {
		lt.t.Stop()
		lt.t = nil
	}
	lt.gen++
}

func (lt *loopTimer) running() bool { return lt.t != nil }

// armForCall (re)arms the message timer for a message that needs a reply. It
// is never armed in a FULL_DUPLEX direction, headers message included (§5).
func (d *direction) armForCall() {
	if !d.fullDuplex() {
		d.startTimer(d.x.cfg.Failure.MessageTimeout)
	}
}

func (d *direction) startTimer(dur time.Duration) {
	x := d.x
	d.timer.start(x, dur, func() { x.onMessageTimeout(d) })
}

// restartTimer applies an override_message_timeout the rules accepted for
// this direction (§5).
func (d *direction) restartTimer(dur time.Duration) {
	if d.timer.running() {
		d.startTimer(dur)
	}
}

// resetIdle re-arms the HCM stream_idle_timeout on stream activity.
func (x *exchange) resetIdle() {
	if x.cfg.Limits.StreamIdleTimeout <= 0 {
		return
	}
	x.idle.start(x, x.cfg.Limits.StreamIdleTimeout, func() {
		if x.finished {
			return
		}
		// 504 once the request is complete (the FULL_DUPLEX test of §5),
		// 408 while the client is still sending.
		code := http.StatusRequestTimeout
		if x.down.bodyDone {
			code = http.StatusGatewayTimeout
		}
		x.localReply(code, "SI", "stream timeout", "stream_idle_timeout")
	})
}

// startRouteTimer arms the route timeout once the whole request reached the
// router (§5); 0 disables it.
func (rt *router) startRouteTimer(d time.Duration) {
	if d <= 0 {
		return
	}
	x := rt.x
	rt.timer.start(x, d, func() {
		if !x.finished {
			x.localReply(http.StatusGatewayTimeout, "UT", "upstream request timeout", "upstream_response_timeout")
		}
	})
}
