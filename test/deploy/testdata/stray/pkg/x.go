package x

// The rule is in docs/envoy.md §2.6 and in others-2026.md.
// See ../notes/ for why, and [the plan](plans/later.txt).
var y = x.md // not a document

/* The design: ../team/design.md, and
   docs/envoy.md §2.6 holds;
   §3 does not. */

const (
	dir  = "../team/"
	note = `../../notes/PLAN.md`
	url  = "https://example.com/a/b.md"
	home = "/etc/envoy/envoy.yaml"
	plan = "see plans/later.md"
	up   = "../notes"
)
