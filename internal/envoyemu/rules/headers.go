package rules

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
)

// Envoy's rules for the header mutations of a reply (docs/envoy.md §3.2–§3.3):
// which names and values it takes at all, and which entries the filter's
// mutation_rules let through. The emulator applies mutations by them; the
// handlers' fuzz checker judges the server's mutations by them.

// Op is what a header mutation entry does to its header.
type Op int

const (
	OpSet    Op = iota
	OpAppend    // a value added to a header already there
	OpRemove
)

// Check is what Envoy does with one header mutation entry.
type Check int

const (
	CheckOK     Check = iota
	CheckIgnore       // silently skipped, counted as rejected_header_mutations
	CheckFail         // local reply status_on_error (disallow_is_error)
)

// HeaderRules is the compiled HeaderMutationRules of the filter (§3.3).
type HeaderRules struct {
	allowAllRouting bool
	allowEnvoy      bool
	disallowSystem  bool
	disallowAll     bool
	disallowIsError bool
	allowExpr       *regexp.Regexp
	disallowExpr    *regexp.Regexp
	envoyPrefix     string
}

// NewHeaderRules compiles the filter's mutation_rules (nil: Envoy's defaults)
// with the bootstrap's header_prefix ("": x-envoy).
func NewHeaderRules(r *mutationrulesv3.HeaderMutationRules, headerPrefix string) (*HeaderRules, error) {
	if headerPrefix == "" {
		headerPrefix = "x-envoy"
	}
	out := &HeaderRules{envoyPrefix: strings.ToLower(headerPrefix)}
	if r == nil {
		return out, nil
	}
	out.allowAllRouting = r.GetAllowAllRouting().GetValue()
	out.allowEnvoy = r.GetAllowEnvoy().GetValue()
	out.disallowSystem = r.GetDisallowSystem().GetValue()
	out.disallowAll = r.GetDisallowAll().GetValue()
	out.disallowIsError = r.GetDisallowIsError().GetValue()
	var err error
	// Envoy's RegexMatcher matches the whole string.
	if e := r.GetAllowExpression(); e != nil {
		if out.allowExpr, err = regexp.Compile("^(?:" + e.GetRegex() + ")$"); err != nil {
			return nil, fmt.Errorf("mutation_rules.allow_expression: %w", err)
		}
	}
	if e := r.GetDisallowExpression(); e != nil {
		if out.disallowExpr, err = regexp.Compile("^(?:" + e.GetRegex() + ")$"); err != nil {
			return nil, fmt.Errorf("mutation_rules.disallow_expression: %w", err)
		}
	}
	return out, nil
}

// Check judges one entry on a lower-case name: the rule table, then, but for
// a removal, the value.
func (r *HeaderRules) Check(op Op, name, value string) Check {
	if !r.allowed(op, name) || (op != OpRemove && !valueIsValid(name, value)) {
		if r.disallowIsError {
			return CheckFail
		}
		return CheckIgnore
	}
	return CheckOK
}

// Remove judges one remove_headers entry on a lower-case name: ":" headers and
// host are never removed (isModifiableHeader), even where the rules allow it,
// and under disallow_is_error trying to is an error.
func (r *HeaderRules) Remove(name string) Check { return r.Check(OpRemove, name, "") }

func isSystemHeader(name string) bool { return strings.HasPrefix(name, ":") || name == "host" }

func isRoutingHeader(name string) bool {
	switch name {
	case ":authority", "host", ":method", ":scheme":
		return true
	}
	return false
}

// allowed is the rule table of §3.3: disallow_expression beats everything,
// allow_expression beats everything else.
func (r *HeaderRules) allowed(op Op, name string) bool {
	if op == OpRemove && isSystemHeader(name) {
		return false // "No matter what", before any expression
	}
	if r.disallowExpr != nil && r.disallowExpr.MatchString(name) {
		return false
	}
	if r.allowExpr != nil && r.allowExpr.MatchString(name) {
		return true
	}
	if r.disallowAll {
		return false
	}
	if isSystemHeader(name) {
		if r.disallowSystem {
			return false
		}
		// System headers cannot carry several values.
		if op == OpAppend {
			return false
		}
		if isRoutingHeader(name) && !r.allowAllRouting {
			return false
		}
	}
	if !r.allowEnvoy && strings.HasPrefix(name, r.envoyPrefix) {
		return false
	}
	return true
}

// valueIsValid holds the per-header value checks of §3.3.
func valueIsValid(name, value string) bool {
	switch name {
	case ":authority", "host":
		return authorityIsValid(value)
	case ":scheme":
		return value == "http" || value == "https"
	case ":status":
		n, err := strconv.Atoi(value)
		return err == nil && n >= 200 && n <= 999
	case ":method":
		return IsToken(value)
	}
	return true
}

func authorityIsValid(v string) bool {
	if v == "" {
		return false
	}
	for i := 0; i < len(v); i++ {
		c := v[i]
		if c <= ' ' || c == 0x7f || strings.IndexByte("/?#@\"<>\\^`{|}", c) >= 0 {
			return false
		}
	}
	return true
}

// IsToken reports whether s is a non-empty RFC 9110 token.
func IsToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return s != ""
}

// HeaderNameIsValid mirrors Envoy's HeaderUtility::headerNameIsValid:
// pseudo-headers use HTTP/2 rules (lower-case only), other names HTTP/1 token
// rules. A mutation naming another is a 500.
func HeaderNameIsValid(name string) bool {
	if pseudo, ok := strings.CutPrefix(name, ":"); ok {
		return IsToken(pseudo) && strings.ToLower(pseudo) == pseudo
	}
	return IsToken(name)
}

// HeaderValueIsValid follows nghttp2's check: HTAB, SP, VCHAR and obs-text.
// NUL, CR, LF and other controls are refused: a mutation setting one is a 500.
func HeaderValueIsValid(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; c != '\t' && (c < 0x20 || c == 0x7f) {
			return false
		}
	}
	return true
}
