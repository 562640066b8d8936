package envoyemu

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	celv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/filters/cel/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/common/ast"
	"github.com/google/cel-go/common/types"
)

// celFilterName is the CEL access-log filter's extension name (§15).
const celFilterName = "envoy.access_loggers.extension_filters.cel"

// celAttributes are the response attributes a CEL filter may read here. The
// emulator has no others to give: an expression that reads another is
// refused, rather than evaluated unlike Envoy.
var celAttributes = []string{"code", "code_details"}

// replyFilter is a mapper's access-log filter (AccessLog::FilterFactory::
// fromProto in Envoy's access_log_impl.cc): its verdict on a reply.
type replyFilter interface {
	match(f *replyFacts) bool
}

// flagFilter is a response_flag_filter: it matches a reply carrying any of
// its flags, or with flags empty any flag (ResponseFlagFilter::evaluate).
type flagFilter []string

func (flags flagFilter) match(f *replyFacts) bool {
	if len(flags) == 0 {
		return len(f.flags) > 0
	}
	return slices.ContainsFunc(f.flags, func(set string) bool { return slices.Contains(flags, set) })
}

// celFilter is the CEL extension_filter. It matches only when the
// expression evaluates to true: an error, or any other value, does not
// match, as Envoy's CELAccessLogExtensionFilter has it.
type celFilter struct{ expr cel.Program }

func (c celFilter) match(f *replyFacts) bool {
	out, _, err := c.expr.Eval(map[string]any{"response": map[string]any{
		"code": int64(f.code), "code_details": f.details,
	}})
	return err == nil && out == types.True
}

// andFilter and orFilter are and_filter and or_filter: every (any) filter
// matches, evaluated in order until the verdict is known (AndFilter and
// OrFilter::evaluate). The proto's validation wants two filters at least.
type (
	andFilter []replyFilter
	orFilter  []replyFilter
)

func (fs andFilter) match(f *replyFacts) bool {
	for _, rf := range fs {
		if !rf.match(f) {
			return false
		}
	}
	return true
}

func (fs orFilter) match(f *replyFacts) bool {
	for _, rf := range fs {
		if rf.match(f) {
			return true
		}
	}
	return false
}

// headerFilter is a header_filter: its matcher on the request's headers, as
// the filter chain holds them when the reply is made (a processor's header
// mutations included). Envoy's HeaderFilter::evaluate is
// HeaderUtility::matchHeaders (header_utility.cc): a header the request
// lacks matches no string matcher, inverted or not; several values are
// joined with "," first; then the string matcher (stringMatches), inverted
// by invert_match.
type headerFilter struct {
	name   string
	value  *matcherv3.StringMatcher
	invert bool
}

func (h headerFilter) match(f *replyFacts) bool {
	if f.request == nil {
		return false // Envoy's empty request headers: no value to match
	}
	var values []string
	for _, e := range f.request.entries {
		if e.key == h.name {
			values = append(values, e.value)
		}
	}
	if len(values) == 0 {
		return false
	}
	return stringMatches(h.value, strings.Join(values, ",")) != h.invert
}

func replyFilterFromProto(f *accesslogv3.AccessLogFilter) (replyFilter, error) {
	switch {
	case f.GetResponseFlagFilter() != nil:
		return flagFilter(f.GetResponseFlagFilter().GetFlags()), nil
	case f.GetAndFilter() != nil:
		fs, err := replyFiltersFromProto("and_filter", f.GetAndFilter().GetFilters())
		return andFilter(fs), err
	case f.GetOrFilter() != nil:
		fs, err := replyFiltersFromProto("or_filter", f.GetOrFilter().GetFilters())
		return orFilter(fs), err
	case f.GetHeaderFilter() != nil:
		return headerFilterFromProto(f.GetHeaderFilter().GetHeader())
	}
	ext := f.GetExtensionFilter()
	if ext == nil || ext.GetName() != celFilterName {
		return nil, errors.New("only response_flag_filter, header_filter, and_filter, or_filter and the CEL extension_filter are emulated")
	}
	var c celv3.ExpressionFilter
	if err := ext.GetTypedConfig().UnmarshalTo(&c); err != nil {
		return nil, fmt.Errorf("%s: %w", celFilterName, err)
	}
	prg, err := compileReplyExpression(c.GetExpression())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", celFilterName, err)
	}
	return celFilter{expr: prg}, nil
}

func replyFiltersFromProto(what string, protos []*accesslogv3.AccessLogFilter) ([]replyFilter, error) {
	var out []replyFilter
	for i, p := range protos {
		rf, err := replyFilterFromProto(p)
		if err != nil {
			return nil, fmt.Errorf("%s.filters[%d]: %w", what, i, err)
		}
		out = append(out, rf)
	}
	return out, nil
}

// headerFilterFromProto takes a HeaderMatcher with a string_match (exact,
// prefix, suffix, contains or safe_regex, which must match the whole value:
// Envoy's RE2 FullMatch), inverted or not; it refuses the other specifiers.
func headerFilterFromProto(m *routev3.HeaderMatcher) (replyFilter, error) {
	sm := m.GetStringMatch()
	switch {
	case sm == nil:
		return nil, errors.New("header_filter: only a string_match header matcher is emulated")
	case m.GetTreatMissingHeaderAsEmpty():
		return nil, errors.New("header_filter: treat_missing_header_as_empty is not emulated")
	case m.GetName() == "":
		return nil, errors.New("header_filter: the header matcher names no header")
	}
	switch p := sm.GetMatchPattern().(type) {
	case *matcherv3.StringMatcher_Exact, *matcherv3.StringMatcher_Prefix, *matcherv3.StringMatcher_Suffix, *matcherv3.StringMatcher_Contains:
	case *matcherv3.StringMatcher_SafeRegex:
		if _, err := regexp.Compile(`^(?:` + p.SafeRegex.GetRegex() + `)$`); err != nil {
			return nil, fmt.Errorf("header_filter: %w", err)
		}
	default:
		return nil, errors.New("header_filter: only exact, prefix, suffix, contains and safe_regex string matchers are emulated")
	}
	return headerFilter{name: strings.ToLower(m.GetName()), value: sm, invert: m.GetInvertMatch()}, nil
}

// compileReplyExpression parses a CEL expression over `response`, refusing
// what Envoy refuses at load (a syntax error) and what the emulator cannot
// evaluate (other attributes).
func compileReplyExpression(src string) (cel.Program, error) {
	env, err := cel.NewEnv(cel.Variable("response", cel.MapType(cel.StringType, cel.DynType)))
	if err != nil {
		return nil, err
	}
	checked, iss := env.Compile(src)
	if iss.Err() != nil {
		return nil, iss.Err()
	}
	isResponse := func(e ast.Expr) bool { return e.Kind() == ast.IdentKind && e.AsIdent() == "response" }
	var unknown error
	ast.PreOrderVisit(checked.NativeRep().Expr(), ast.NewExprVisitor(func(e ast.Expr) {
		switch {
		case e.Kind() == ast.SelectKind && isResponse(e.AsSelect().Operand()):
			if field := e.AsSelect().FieldName(); !slices.Contains(celAttributes, field) {
				unknown = fmt.Errorf("response.%s is not emulated (only response.code and response.code_details)", field)
			}
		case e.Kind() == ast.CallKind && e.AsCall().FunctionName() == "_[_]" && isResponse(e.AsCall().Args()[0]):
			unknown = errors.New("response[...] is not emulated (only response.code and response.code_details)")
		}
	}))
	if unknown != nil {
		return nil, unknown
	}
	return env.Program(checked)
}
