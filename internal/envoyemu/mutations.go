package envoyemu

import (
	"errors"
	"fmt"
	"strings"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pd-extproc/pd-extproc/internal/envoyemu/rules"
)

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
func applyHeaderMutation(m *extprocv3.HeaderMutation, h *headerMap, hr *rules.HeaderRules, lim mutationLimits, opt mutationOptions) (int, error) {
	if m == nil {
		return 0, nil
	}
	if len(m.GetRemoveHeaders()) > lim.maxHeadersCount || len(m.GetSetHeaders()) > lim.maxHeadersCount {
		return 0, fmt.Errorf("%w: header mutation has more entries than the header count limit", errMutation)
	}
	rejected := 0
	for _, name := range m.GetRemoveHeaders() {
		lname := strings.ToLower(name)
		if !rules.HeaderNameIsValid(lname) {
			return rejected, fmt.Errorf("%w: Invalid character in remove_headers mutation.", errMutation)
		}
		switch hr.Remove(lname) {
		case rules.CheckOK:
			h.remove(lname)
		case rules.CheckIgnore:
			rejected++
		case rules.CheckFail:
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
		if !rules.HeaderNameIsValid(hv.GetKey()) || !rules.HeaderValueIsValid(value) {
			return rejected, fmt.Errorf("%w: Invalid character in set_headers mutation.", errMutation)
		}
		name := strings.ToLower(hv.GetKey())
		// §3.2: only the deprecated append BoolValue counts; append_action is
		// ignored.
		appendValue := sh.GetAppend().GetValue()
		op := rules.OpSet
		if appendValue && h.has(name) {
			op = rules.OpAppend
		}
		res := hr.Check(op, name, value)
		if opt.replacing && name == ":method" {
			res = rules.CheckOK
		}
		switch res {
		case rules.CheckOK:
			if appendValue {
				h.add(name, value)
			} else {
				h.set(name, value)
			}
		case rules.CheckIgnore:
			rejected++
		case rules.CheckFail:
			return rejected, fmt.Errorf("%w: Invalid attempt to modify %s", errMutation, hv.GetKey())
		}
	}
	if len(h.entries) > lim.maxHeadersCount || h.byteSize() > lim.maxHeadersKB*1024 {
		return rejected, fmt.Errorf("%w: header map exceeds the header limits after mutation", errMutation)
	}
	return rejected, nil
}
