package envoyemu

import (
	"errors"
	"fmt"
	"slices"

	accesslogv3 "github.com/envoyproxy/go-control-plane/envoy/config/accesslog/v3"
	celv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/filters/cel/v3"
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

// replyFilter is a mapper's access-log filter: a response_flag_filter (flags;
// empty matches any reply with a flag) or a CEL extension_filter.
type replyFilter struct {
	flags []string
	expr  cel.Program
}

// match is the filter's verdict on a reply. A CEL expression matches only
// when it evaluates to true: an error, or any other value, does not match,
// as Envoy's CELAccessLogExtensionFilter has it.
func (rf replyFilter) match(f *replyFacts) bool {
	if rf.expr != nil {
		out, _, err := rf.expr.Eval(map[string]any{"response": map[string]any{
			"code": int64(f.code), "code_details": f.details,
		}})
		return err == nil && out == types.True
	}
	if f.flag == "" {
		return false
	}
	return len(rf.flags) == 0 || slices.Contains(rf.flags, f.flag)
}

func replyFilterFromProto(f *accesslogv3.AccessLogFilter) (replyFilter, error) {
	if rf := f.GetResponseFlagFilter(); rf != nil {
		return replyFilter{flags: rf.GetFlags()}, nil
	}
	ext := f.GetExtensionFilter()
	if ext == nil || ext.GetName() != celFilterName {
		return replyFilter{}, errors.New("only response_flag_filter and the CEL extension_filter are emulated")
	}
	var c celv3.ExpressionFilter
	if err := ext.GetTypedConfig().UnmarshalTo(&c); err != nil {
		return replyFilter{}, fmt.Errorf("%s: %w", celFilterName, err)
	}
	prg, err := compileReplyExpression(c.GetExpression())
	if err != nil {
		return replyFilter{}, fmt.Errorf("%s: %w", celFilterName, err)
	}
	return replyFilter{expr: prg}, nil
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
