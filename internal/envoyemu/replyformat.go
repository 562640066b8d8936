package envoyemu

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// LocalReplies is the connection manager's local_reply_config (§15): how
// Envoy rewrites every local reply, its own and the processor's immediate
// responses alike. The zero value leaves them as they are.
type LocalReplies struct {
	Mappers []ReplyMapper
	Format  *ReplyFormat // body_format; nil: the body as it is, text/plain
}

// ReplyMapper is one of local_reply_config's mappers.
type ReplyMapper struct {
	filter replyFilter
	Status int     // status_code; 0 keeps the reply's
	Body   *string // body (inline); nil keeps the reply's
	Format *ReplyFormat
}

// ReplyFormat is a SubstitutionFormatString: a text or JSON template over the
// command operators the emulator knows (replyOperators).
type ReplyFormat struct {
	text        string           // the text template
	json        *structpb.Struct // or the JSON one
	contentType string
}

// replyOperators are the command operators a reply's format may use, and
// what each reads: nil for none ("-" in text).
var replyOperators = map[string]func(f *replyFacts) any{
	"LOCAL_REPLY_BODY":      func(f *replyFacts) any { return f.body },
	"RESPONSE_CODE":         func(f *replyFacts) any { return f.code },
	"RESPONSE_CODE_DETAILS": func(f *replyFacts) any { return orNil(f.details) },
	"RESPONSE_FLAGS":        func(f *replyFacts) any { return orNil(strings.Join(f.flags, ",")) },
}

// replyFacts are what the operators read.
type replyFacts struct {
	body    string
	code    int
	details string
	flags   []string   // the response flags, in the order set
	request *headerMap // the request's headers, nil before any arrived
}

// rewrite is Envoy's LocalReply rewrite: the first mapper whose filter
// matches sets the status, the body and the format; then the format (the
// mapper's, else body_format, else the body itself as text/plain) makes the
// body, with its content type.
func (lr LocalReplies) rewrite(f *replyFacts) (contentType string) {
	format := lr.Format
	for _, m := range lr.Mappers {
		if !m.filter.match(f) {
			continue
		}
		if m.Body != nil {
			f.body = *m.Body
		}
		if m.Status != 0 {
			f.code = m.Status
		}
		if m.Format != nil {
			format = m.Format
		}
		break
	}
	if format == nil {
		return "text/plain"
	}
	f.body = format.format(f)
	return format.contentType
}

func (rf *ReplyFormat) format(f *replyFacts) string {
	if rf.json == nil {
		return f.render(rf.text)
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b) // one line, keys sorted, then "\n" as Envoy ends a JSON line
	enc.SetEscapeHTML(false)
	_ = enc.Encode(f.value(structpb.NewStructValue(rf.json)))
	return b.String()
}

// text is one part of a template: an operator's value ("-" for none, as
// Envoy writes an empty one), or the literal text.
func (f *replyFacts) text(part string) string {
	op, ok := operator(part)
	if !ok {
		return part
	}
	switch v := replyOperators[op](f).(type) {
	case nil:
		return "-"
	case int:
		return strconv.Itoa(v)
	default:
		return v.(string)
	}
}

// value fills a JSON template: a string that is one operator keeps its
// value's type (RESPONSE_CODE a number), others are strings.
func (f *replyFacts) value(v *structpb.Value) any {
	switch k := v.GetKind().(type) {
	case *structpb.Value_StructValue:
		out := map[string]any{}
		for name, field := range k.StructValue.GetFields() {
			out[name] = f.value(field)
		}
		return out
	case *structpb.Value_ListValue:
		out := []any{}
		for _, item := range k.ListValue.GetValues() {
			out = append(out, f.value(item))
		}
		return out
	case *structpb.Value_NumberValue:
		return k.NumberValue
	}
	if op, ok := operator(v.GetStringValue()); ok && !strings.Contains(op, "%") {
		return replyOperators[op](f)
	}
	return f.render(v.GetStringValue())
}

// render fills a text template.
func (f *replyFacts) render(template string) string {
	var b strings.Builder
	for _, part := range splitOperators(template) {
		b.WriteString(f.text(part))
	}
	return b.String()
}

func orNil(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// splitOperators cuts a template into literal text and %OPERATOR% parts.
func splitOperators(s string) []string {
	var parts []string
	for s != "" {
		i := strings.IndexByte(s, '%')
		j := -1
		if i >= 0 {
			j = strings.IndexByte(s[i+1:], '%')
		}
		if j < 0 {
			return append(parts, s)
		}
		if i > 0 {
			parts = append(parts, s[:i])
		}
		parts, s = append(parts, s[i:i+j+2]), s[i+j+2:]
	}
	return parts
}

func operator(part string) (string, bool) {
	if len(part) < 3 || part[0] != '%' || part[len(part)-1] != '%' {
		return "", false
	}
	return part[1 : len(part)-1], true
}

func localRepliesFromProto(c *hcmv3.LocalReplyConfig) (LocalReplies, error) {
	var lr LocalReplies
	var err error
	if lr.Format, err = replyFormatFromProto(c.GetBodyFormat()); err != nil {
		return lr, fmt.Errorf("local_reply_config.body_format: %w", err)
	}
	for i, m := range c.GetMappers() {
		filter, err := replyFilterFromProto(m.GetFilter())
		switch {
		case err != nil:
			return lr, fmt.Errorf("local_reply_config.mappers[%d].filter: %w", i, err)
		case len(m.GetHeadersToAdd()) > 0:
			return lr, fmt.Errorf("local_reply_config.mappers[%d]: headers_to_add is not emulated", i)
		case m.GetBody() != nil && m.GetBody().GetInlineString() == "":
			return lr, fmt.Errorf("local_reply_config.mappers[%d]: only an inline_string body is emulated", i)
		}
		mapper := ReplyMapper{filter: filter, Status: int(m.GetStatusCode().GetValue())}
		if m.GetBody() != nil {
			body := m.GetBody().GetInlineString()
			mapper.Body = &body
		}
		if mapper.Format, err = replyFormatFromProto(m.GetBodyFormatOverride()); err != nil {
			return lr, fmt.Errorf("local_reply_config.mappers[%d].body_format_override: %w", i, err)
		}
		lr.Mappers = append(lr.Mappers, mapper)
	}
	return lr, nil
}

func replyFormatFromProto(s *corev3.SubstitutionFormatString) (*ReplyFormat, error) {
	if s == nil {
		return nil, nil
	}
	if s.GetOmitEmptyValues() || len(s.GetFormatters()) > 0 || s.GetJsonFormatOptions() != nil {
		return nil, errors.New("omit_empty_values, formatters and json_format_options are not emulated")
	}
	rf := &ReplyFormat{contentType: s.GetContentType()}
	var templates []string
	switch f := s.GetFormat().(type) {
	case *corev3.SubstitutionFormatString_JsonFormat:
		rf.json = f.JsonFormat
		if rf.contentType == "" {
			rf.contentType = "application/json"
		}
		var err error
		if templates, err = jsonTemplates(structpb.NewStructValue(f.JsonFormat)); err != nil {
			return nil, err
		}
	case *corev3.SubstitutionFormatString_TextFormat:
		templates = []string{f.TextFormat}
	case *corev3.SubstitutionFormatString_TextFormatSource:
		if f.TextFormatSource.GetInlineString() == "" {
			return nil, errors.New("only an inline_string text_format_source is emulated")
		}
		templates = []string{f.TextFormatSource.GetInlineString()}
	}
	if rf.json == nil {
		rf.text = templates[0]
		if rf.contentType == "" {
			rf.contentType = "text/plain"
		}
	}
	for _, t := range templates {
		for _, part := range splitOperators(t) {
			if op, ok := operator(part); ok && replyOperators[op] == nil {
				return nil, fmt.Errorf("command operator %%%s%% is not emulated", op)
			}
		}
	}
	return rf, nil
}

// jsonTemplates lists a JSON format's strings; like Envoy, it refuses
// values other than strings, numbers, objects and lists.
func jsonTemplates(v *structpb.Value) ([]string, error) {
	var children []*structpb.Value
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return []string{k.StringValue}, nil
	case *structpb.Value_NumberValue:
		return nil, nil
	case *structpb.Value_StructValue:
		for _, field := range k.StructValue.GetFields() {
			children = append(children, field)
		}
	case *structpb.Value_ListValue:
		children = k.ListValue.GetValues()
	default:
		return nil, errors.New("only string values, nested structs, list values and number values are supported in json_format")
	}
	var out []string
	for _, c := range children {
		t, err := jsonTemplates(c)
		if err != nil {
			return nil, err
		}
		out = append(out, t...)
	}
	return out, nil
}
