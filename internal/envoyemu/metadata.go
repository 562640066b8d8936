package envoyemu

import (
	"regexp"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// buildMetadataContext is Filter::addDynamicMetadata (§1.4): the stream's
// metadata for each forwarding namespace that has a value.
func buildMetadataContext(namespaces []string, md map[string]*structpb.Struct) *corev3.Metadata {
	out := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{}}
	for _, ns := range namespaces {
		if s, ok := md[ns]; ok {
			out.FilterMetadata[ns] = proto.Clone(s).(*structpb.Struct)
		}
	}
	return out
}

// servedKey is where a gateway of the endpoint-picker protocol reports the
// endpoint that served the request, in the envoy.lb namespace (§8.2).
const servedKey = "x-gateway-destination-endpoint-served"

// setServed reports addr as the endpoint that served, on the stream's
// metadata, which the response path's messages carry where
// forwarding_namespaces lists envoy.lb.
func setServed(md map[string]*structpb.Struct, addr string) {
	s := md["envoy.lb"]
	if s == nil {
		s = &structpb.Struct{Fields: map[string]*structpb.Value{}}
		md["envoy.lb"] = s
	}
	s.Fields[servedKey] = structpb.NewStringValue(addr)
}

// metadataValue walks a MetadataKey (namespace + path) as ORIGINAL_DST does.
func metadataValue(md map[string]*structpb.Struct, ns string, path []string) (*structpb.Value, bool) {
	s, ok := md[ns]
	if !ok {
		return nil, false
	}
	v := structpb.NewStructValue(s)
	for _, key := range path {
		st := v.GetStructValue()
		if st == nil {
			return nil, false
		}
		if v, ok = st.GetFields()[key]; !ok {
			return nil, false
		}
	}
	return v, true
}

// headerForwardingAllowed applies forward_rules (§1.3).
func headerForwardingAllowed(rules *extprocfilterv3.HeaderForwardingRules, key string) bool {
	if rules == nil {
		return true
	}
	if a := rules.GetAllowedHeaders(); a != nil && !listMatches(a, key) {
		return false
	}
	if d := rules.GetDisallowedHeaders(); d != nil && listMatches(d, key) {
		return false
	}
	return true
}

func listMatches(l *matcherv3.ListStringMatcher, s string) bool {
	for _, m := range l.GetPatterns() {
		if stringMatches(m, s) {
			return true
		}
	}
	return false
}

func stringMatches(m *matcherv3.StringMatcher, s string) bool {
	fold := func(v string) string { return v }
	if m.GetIgnoreCase() {
		fold = strings.ToLower
	}
	switch p := m.GetMatchPattern().(type) {
	case *matcherv3.StringMatcher_Exact:
		return fold(s) == fold(p.Exact)
	case *matcherv3.StringMatcher_Prefix:
		return strings.HasPrefix(fold(s), fold(p.Prefix))
	case *matcherv3.StringMatcher_Suffix:
		return strings.HasSuffix(fold(s), fold(p.Suffix))
	case *matcherv3.StringMatcher_Contains:
		return strings.Contains(fold(s), fold(p.Contains))
	case *matcherv3.StringMatcher_SafeRegex:
		re, err := regexp.Compile("^(?:" + p.SafeRegex.GetRegex() + ")$")
		return err == nil && re.MatchString(s)
	}
	return false
}
