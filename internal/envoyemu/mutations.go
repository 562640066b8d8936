package envoyemu

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	mutationrulesv3 "github.com/envoyproxy/go-control-plane/envoy/config/common/mutation_rules/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// checkResult is the outcome of a mutation rule check (§3.3).
type checkResult int

const (
	checkOK     checkResult = iota
	checkIgnore             // silently skipped, counted as rejected_header_mutations
	checkFail               // local reply status_on_error (disallow_is_error)
)

type checkOp int

const (
	opSet checkOp = iota
	opAppend
	opRemove
)

// mutationRules is the compiled HeaderMutationRules of the filter (§3.3).
type mutationRules struct {
	allowAllRouting bool
	allowEnvoy      bool
	disallowSystem  bool
	disallowAll     bool
	disallowIsError bool
	allowExpr       *regexp.Regexp
	disallowExpr    *regexp.Regexp
	envoyPrefix     string
}

func compileRules(r *mutationrulesv3.HeaderMutationRules, headerPrefix string) (*mutationRules, error) {
	if headerPrefix == "" {
		headerPrefix = "x-envoy"
	}
	out := &mutationRules{envoyPrefix: strings.ToLower(headerPrefix)}
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

func isSystemHeader(name string) bool { return strings.HasPrefix(name, ":") || name == "host" }

func isRoutingHeader(name string) bool {
	switch name {
	case ":authority", "host", ":method", ":scheme":
		return true
	}
	return false
}

// isAllowed is the rule table of §3.3: disallow_expression beats everything,
// allow_expression beats everything else.
func (r *mutationRules) isAllowed(op checkOp, name string) bool {
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
		if op == opAppend {
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

// isValidValue holds the per-header value checks of §3.3.
func isValidValue(name, value string) bool {
	switch name {
	case ":authority", "host":
		return authorityIsValid(value)
	case ":scheme":
		return value == "http" || value == "https"
	case ":status":
		n, err := strconv.Atoi(value)
		return err == nil && n >= 200 && n <= 999
	case ":method":
		return isToken(value)
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

func (r *mutationRules) check(op checkOp, name, value string) checkResult {
	if !r.isAllowed(op, name) || (op != opRemove && !isValidValue(name, value)) {
		if r.disallowIsError {
			return checkFail
		}
		return checkIgnore
	}
	return checkOK
}

// mutationLimits are the connection manager's header limits that bound a
// mutation (§3.2 "preliminary limit check").
type mutationLimits struct {
	maxHeadersCount int
	maxHeadersKB    int
}

// mutationOptions say how one header mutation is applied.
type mutationOptions struct {
	// dropContentLength: the direction's shouldRemoveContentLength() holds, so
	// content-length entries in set_headers are skipped silently (§3.2, §3.5).
	dropContentLength bool
	// replacing: CONTINUE_AND_REPLACE, which may change :method (§3.1).
	replacing bool
}

// errMutation marks an invalid mutation: always a local reply with
// status_on_error, even with failure_mode_allow (§5 failure table).
var errMutation = errors.New("invalid mutation")

// applyHeaderMutation is Envoy's MutationUtils::applyHeaderMutations (§3.2).
// It returns the number of rejected (ignored) mutations.
func applyHeaderMutation(m *extprocv3.HeaderMutation, h *headerMap, rules *mutationRules, lim mutationLimits, opt mutationOptions) (int, error) {
	if m == nil {
		return 0, nil
	}
	if len(m.GetRemoveHeaders()) > lim.maxHeadersCount || len(m.GetSetHeaders()) > lim.maxHeadersCount {
		return 0, fmt.Errorf("%w: header mutation has more entries than the header count limit", errMutation)
	}
	rejected := 0
	for _, name := range m.GetRemoveHeaders() {
		lname := strings.ToLower(name)
		if !headerNameIsValid(lname) {
			return rejected, fmt.Errorf("%w: Invalid character in remove_headers mutation.", errMutation)
		}
		switch rules.check(opRemove, lname, "") {
		case checkOK:
			// ":" headers and host can never be removed (isModifiableHeader).
			if isSystemHeader(lname) {
				rejected++
				continue
			}
			h.remove(lname)
		case checkIgnore:
			rejected++
		case checkFail:
			return rejected, fmt.Errorf("%w: Invalid attempt to remove %s", errMutation, lname)
		}
	}
	for _, sh := range m.GetSetHeaders() {
		hv := sh.GetHeader()
		if hv == nil {
			continue
		}
		// §3.2: both fields set is refused outright (semantic-router#253).
		if hv.GetValue() != "" && len(hv.GetRawValue()) != 0 {
			return rejected, fmt.Errorf("%w: Only one of value or raw_value in HeaderValue can be set", errMutation)
		}
		if opt.dropContentLength && strings.EqualFold(hv.GetKey(), "content-length") {
			continue
		}
		// §3.2: only raw_value is read; a value-only header becomes empty
		// (envoy#31555).
		value := string(hv.GetRawValue())
		if !headerNameIsValid(hv.GetKey()) || !headerValueIsValid(value) {
			return rejected, fmt.Errorf("%w: Invalid character in set_headers mutation.", errMutation)
		}
		name := strings.ToLower(hv.GetKey())
		// §3.2: only the deprecated append BoolValue counts; append_action is
		// ignored.
		appendValue := sh.GetAppend().GetValue()
		op := opSet
		if appendValue && h.has(name) {
			op = opAppend
		}
		res := rules.check(op, name, value)
		if opt.replacing && name == ":method" {
			res = checkOK
		}
		switch res {
		case checkOK:
			if appendValue {
				h.add(name, value)
			} else {
				h.set(name, value)
			}
		case checkIgnore:
			rejected++
		case checkFail:
			return rejected, fmt.Errorf("%w: Invalid attempt to modify %s", errMutation, hv.GetKey())
		}
	}
	if len(h.entries) > lim.maxHeadersCount || h.byteSize() > lim.maxHeadersKB*1024 {
		return rejected, fmt.Errorf("%w: header map exceeds the header limits after mutation", errMutation)
	}
	return rejected, nil
}
