package deploy

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// With nameOverride and fullnameOverride, alone or together, every object is named as Helm's
// convention has it (fullnameOverride wins; else the release name when it holds the name, else
// <release>-<name>), and every reference between the rendered objects names one the chart
// renders: the Services', budgets' and NetworkPolicies' selectors select the pods of a rendered
// Deployment, the pods' ServiceAccount, ConfigMaps and certificate Secrets, the RoleBindings'
// Role and subject, the Envoy Gateway objects' targets and backends, the Issuers. A Secret
// counts as rendered when a rendered Certificate writes it.
func TestEveryReferenceNamesARenderedObject(t *testing.T) {
	all := `{monitoring: {serviceMonitor: {enabled: true}, prometheusRule: {enabled: true}, dashboard: {enabled: true}}}`
	for _, tc := range []struct {
		example, values string
		full            string // the full name every object is named after
	}{
		{"defaults", `{fullnameOverride: router, nameOverride: pd}`, "router"},
		{"defaults", `{nameOverride: pd}`, "pd-extproc"}, // the release name holds the name
		{"defaults", `{nameOverride: llm}`, "pd-extproc-llm"},
		{"defaults", `{fullnameOverride: router}`, "router"},
		{"envoy-gateway", `{fullnameOverride: router, nameOverride: pd}`, "router"},
		{"everything", `{fullnameOverride: edge, nameOverride: pd}`, "edge"},
	} {
		t.Run(tc.example+" "+tc.values, func(t *testing.T) {
			ex := example(t, tc.example)
			values, err := ex.ValuesMap()
			if err != nil {
				t.Fatal(err)
			}
			for _, more := range []string{all, tc.values} {
				if err := yaml.Unmarshal([]byte(more), &values); err != nil {
					t.Fatal(err)
				}
			}
			ms := render(t, ex, values)
			find(t, ms, "Deployment", tc.full)
			find(t, ms, "ConfigMap", tc.full)
			for _, e := range danglingRefs(ms) {
				t.Error(e)
			}
		})
	}
}

// danglingRefs lists the references among ms that name no object of ms.
func danglingRefs(ms []manifest) []string {
	type key struct{ kind, ns, name string }
	have := map[key]bool{}
	var pods []map[string]any // the pod labels of each Deployment, by namespace
	podNS := []string{}
	for _, m := range ms {
		ns := digString(m.doc, "metadata", "namespace")
		have[key{m.kind(), ns, m.name()}] = true
		switch m.kind() {
		case "Certificate":
			have[key{"Secret", ns, digString(m.doc, "spec", "secretName")}] = true
		case "Deployment":
			labels, _ := dig(m.doc, "spec", "template", "metadata", "labels").(map[string]any)
			pods, podNS = append(pods, labels), append(podNS, ns)
		}
	}
	var errs []string
	ref := func(m manifest, what, kind, ns, name string) {
		if ns = cmp.Or(ns, digString(m.doc, "metadata", "namespace")); ns == "-" {
			ns = "" // cluster-scoped
		}
		if name != "" && !have[key{kind, ns, name}] {
			errs = append(errs, fmt.Sprintf("%s %s/%s: %s names %s %s/%s, which is not rendered", m.kind(), ns, m.name(), what, kind, ns, name))
		}
	}
	// selected: a selector of the release's pods must select a rendered Deployment's.
	selected := func(m manifest, what string, sel any) {
		s, _ := sel.(map[string]any)
		if s["app.kubernetes.io/instance"] == nil {
			return // the engines', or a peer's not of this release
		}
		for i, labels := range pods {
			if podNS[i] == digString(m.doc, "metadata", "namespace") && selects(sel, labels) {
				return
			}
		}
		errs = append(errs, fmt.Sprintf("%s %s: %s %v selects no rendered Deployment's pods", m.kind(), m.name(), what, sel))
	}
	for _, m := range ms {
		d := m.doc
		switch m.kind() {
		case "Deployment":
			pod := dig(d, "spec", "template", "spec")
			if anyKind(ms, "ServiceAccount") {
				ref(m, "serviceAccountName", "ServiceAccount", "", digString(pod, "serviceAccountName"))
			}
			for _, v := range asList(dig(pod, "volumes")) {
				ref(m, "a volume", "ConfigMap", "", digString(v, "configMap", "name"))
				if s := digString(v, "secret", "secretName"); anyKind(ms, "Certificate") && !strings.HasPrefix(s, "engine-") {
					ref(m, "a volume", "Secret", "", s)
				}
			}
			selected(m, "selector", dig(d, "spec", "selector", "matchLabels"))
		case "Service":
			selected(m, "selector", dig(d, "spec", "selector"))
		case "PodDisruptionBudget":
			selected(m, "selector", dig(d, "spec", "selector", "matchLabels"))
		case "NetworkPolicy":
			selected(m, "podSelector", dig(d, "spec", "podSelector", "matchLabels"))
			for _, rule := range asList(dig(d, "spec", "ingress")) {
				for _, peer := range asList(dig(rule, "from")) {
					if dig(peer, "namespaceSelector") == nil {
						selected(m, "a peer's podSelector", dig(peer, "podSelector", "matchLabels"))
					}
				}
			}
		case "RoleBinding":
			ref(m, "roleRef", digString(d, "roleRef", "kind"), "", digString(d, "roleRef", "name"))
			for _, s := range asList(dig(d, "subjects")) {
				if anyKind(ms, "ServiceAccount") {
					ref(m, "a subject", "ServiceAccount", digString(s, "namespace"), digString(s, "name"))
				}
			}
		case "ServiceMonitor":
			for _, port := range asList(dig(d, "spec", "endpoints")) {
				if !slices.ContainsFunc(ms, func(s manifest) bool { return servesFor(s, dig(d, "spec", "selector"), digString(port, "port")) }) {
					errs = append(errs, fmt.Sprintf("ServiceMonitor %s: no rendered Service it selects has the port %s", m.name(), digString(port, "port")))
				}
			}
		case "EnvoyExtensionPolicy", "BackendTLSPolicy", "ClientTrafficPolicy", "BackendTrafficPolicy", "EnvoyPatchPolicy":
			for _, r := range append(asList(dig(d, "spec", "targetRefs")), dig(d, "spec", "targetRef")) {
				ref(m, "a target", digString(r, "kind"), "", digString(r, "name"))
			}
			for _, p := range asList(dig(d, "spec", "extProc")) {
				for _, b := range asList(dig(p, "backendRefs")) {
					ref(m, "a backendRef", cmp.Or(digString(b, "kind"), "Service"), digString(b, "namespace"), digString(b, "name"))
				}
			}
			for _, r := range asList(dig(d, "spec", "validation", "caCertificateRefs")) {
				if anyKind(ms, "Certificate") {
					ref(m, "caCertificateRefs", digString(r, "kind"), "", digString(r, "name"))
				}
			}
		case "HTTPRoute":
			for _, p := range asList(dig(d, "spec", "parentRefs")) {
				ref(m, "a parentRef", "Gateway", digString(p, "namespace"), digString(p, "name"))
			}
			for _, rule := range asList(dig(d, "spec", "rules")) {
				for _, b := range asList(dig(rule, "backendRefs")) {
					ref(m, "a backendRef", "Service", digString(b, "namespace"), digString(b, "name"))
				}
			}
		case "Gateway":
			if anyKind(ms, "GatewayClass") {
				ref(m, "gatewayClassName", "GatewayClass", "-", digString(d, "spec", "gatewayClassName"))
			}
			ref(m, "parametersRef", "EnvoyProxy", "", digString(d, "spec", "infrastructure", "parametersRef", "name"))
		case "EnvoyProxy":
			if anyKind(ms, "Certificate") {
				ref(m, "clientCertificateRef", "Secret", "", digString(d, "spec", "backendTLS", "clientCertificateRef", "name"))
			}
		case "Certificate":
			if digString(d, "spec", "issuerRef", "kind") == "Issuer" {
				ref(m, "issuerRef", "Issuer", "", digString(d, "spec", "issuerRef", "name"))
			}
		case "Issuer":
			ref(m, "its CA", "Secret", "", digString(d, "spec", "ca", "secretName"))
		}
	}
	return errs
}

// servesFor is whether m is a Service that a ServiceMonitor's selector (matchLabels and
// matchExpressions of operator In) selects, with a port of that name.
func servesFor(m manifest, sel any, port string) bool {
	labels, _ := dig(m.doc, "metadata", "labels").(map[string]any)
	if m.kind() != "Service" || !slices.ContainsFunc(asList(dig(m.doc, "spec", "ports")), func(p any) bool { return digString(p, "name") == port }) {
		return false
	}
	if ml, _ := dig(sel, "matchLabels").(map[string]any); len(ml) > 0 && !selects(ml, labels) {
		return false
	}
	for _, e := range asList(dig(sel, "matchExpressions")) {
		if digString(e, "operator") != "In" || !slices.Contains(asList(dig(e, "values")), labels[digString(e, "key")]) {
			return false
		}
	}
	return true
}

func asList(v any) []any { l, _ := v.([]any); return l }

func anyKind(ms []manifest, kind string) bool {
	for _, m := range ms {
		if m.kind() == kind {
			return true
		}
	}
	return false
}
