package deploy

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/pd-extproc/pd-extproc/internal/chart"
	"github.com/pd-extproc/pd-extproc/internal/testbed"
)

// The names the chart takes from values (gateway.name and the names made from it, the class,
// the namespaces, Secrets and ServiceAccount it names, nameOverride and fullnameOverride in the
// full name) either render names the API server takes, or the chart refuses them, naming the
// value: the longest gateway.name is 56 characters, so that the Service <name>-decode is an
// RFC 1035 label of 63.
func TestChartRefusesNamesKubernetesRefuses(t *testing.T) {
	ex := example(t, "defaults")
	long := func(n int) string { return "g" + strings.Repeat("x", n-1) }
	for _, tc := range []struct {
		name, values string
		want         string // "" renders
	}{
		{"a gateway name of 56 characters", "gateway: {enabled: true, name: " + long(56) + "}", ""},
		{"a gateway name of 57 characters", "gateway: {enabled: true, name: " + long(57) + "}", "gateway.name"},
		{"a gateway name with a dot", "gateway: {enabled: true, name: pd.gateway}", "gateway.name"},
		{"a gateway name starting with a digit", "gateway: {enabled: true, name: 2gateway}", "gateway.name"},
		{"a gateway name in capitals", "gateway: {enabled: true, name: PD-Gateway}", "gateway.name"},
		{"a class name with dots", "gateway: {enabled: true, className: llm.example.com}", ""},
		{"a class name with an underscore", "gateway: {enabled: true, className: llm_class}", "gateway.className"},
		{"the decode Service's namespace in capitals", "gateway: {enabled: true, decodeService: {namespace: Engines}}", "gateway.decodeService.namespace"},
		{"the proxies' namespace of 64 characters", "gateway: {enabled: true, proxyNamespace: " + long(64) + "}", "gateway.proxyNamespace"},
		{"an extra namespace with an underscore", "rbac: {extraNamespaces: [engines_a]}", "rbac.extraNamespaces"},
		{"a client Secret with an underscore", "tls: {clientSecret: router_client}", "tls.clientSecret"},
		{"a server Secret of 254 characters", "tls: {serverSecret: " + long(254) + "}", "tls.serverSecret"},
		{"a ServiceAccount in capitals", "serviceAccount: {name: Router}", "serviceAccount.name"},
		{"an engine key Secret with a space", "engineAPIKey: {secretName: 'api key'}", "engineAPIKey.secretName"},
		{"a name override in capitals", "nameOverride: PD", "nameOverride"},
		{"a full name override with an underscore", "fullnameOverride: router_x", "fullnameOverride"},
		// The label app.kubernetes.io/name is the name override, cut at 63 characters.
		{"a name override ending in a dot", "nameOverride: pd.", "nameOverride"},
		{"a name override with a space beside a full name override", "{fullnameOverride: router, nameOverride: 'pd router'}", "nameOverride"},
		{"a name override in capitals beside a full name override", "{fullnameOverride: router, nameOverride: PD}", ""},
		// A Secret's keys are letters, digits, '-', '_' and '.'; the kubelet mounts no other.
		{"an engine key Secret's key with a slash", "engineAPIKey: {secretName: engine-key, key: keys/api}", "engineAPIKey.key"},
		{"an engine key Secret's key starting with '..'", "engineAPIKey: {secretName: engine-key, key: ..key}", "engineAPIKey.key"},
		{"an engine key Secret's empty key", "engineAPIKey: {secretName: engine-key, key: ''}", "engineAPIKey.key"},
		{"an engine key Secret's key with dots and underscores", "engineAPIKey: {secretName: engine-key, key: API_key.v2}", ""},
		{"an engine CA Secret's key with a space", "{engineCA: {secretName: engine-ca, key: 'ca bundle'}, config: {pools: {decode: {tls: {enabled: true}}}}}", "engineCA.key"},
		{"the decode pool's namespace in capitals", "config: {pools: {decode: {kubernetes: {namespace: Engines}}}}", `config.pools.decode.kubernetes.namespace: "Engines" is not a name`},
		{"the prefill pool's namespace with an underscore", "config: {pools: {prefill: {kubernetes: {namespace: engines_a}}}}", `config.pools.prefill.kubernetes.namespace: "engines_a" is not a name`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			values := map[string]any{}
			if err := yaml.Unmarshal([]byte(tc.values), &values); err != nil {
				t.Fatal(err)
			}
			out, err := chart.Render(testbed.MustRepoPath(t, chart.Dir), ex.Release, values)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("render: %v, want a refusal naming %s", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatalf("render: %v", err)
			}
			for i, part := range splitYAML(out) {
				var doc map[string]any
				if err := yaml.Unmarshal(part, &doc); err != nil {
					t.Fatalf("document %d: %v", i, err)
				}
				m := manifest{doc: doc}
				if doc == nil {
					continue
				}
				check := validation.IsDNS1123Subdomain
				if m.kind() == "Service" {
					check = validation.IsDNS1035Label
				}
				if errs := check(m.name()); errs != nil {
					t.Errorf("%s %q: %v", m.kind(), m.name(), errs)
				}
			}
		})
	}
}
