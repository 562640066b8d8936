{{/* The chart's name, and the release's full name. Services are RFC 1035 labels (a letter first,
at most 63 characters), and the longest name made from the full name is the Service
<fullname>-envoy-stats: the full name keeps to 51 characters, a release name that starts with a
digit goes after the chart's name, and a dot (Helm allows them) becomes a dash. */}}
{{- define "pd-extproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pd-extproc.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- $full := .Values.fullnameOverride }}
{{- if not $full }}
{{- $full = ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name) }}
{{- if not (regexMatch "^[a-z]" $full) }}
{{- $full = printf "%s-%s" $name .Release.Name }}
{{- end }}
{{- end }}
{{- $full = $full | replace "." "-" | trunc 51 | trimSuffix "-" }}
{{- if not (regexMatch "^([a-z]|[a-z][-a-z0-9]*[a-z0-9])$" $full) }}
{{- fail (printf "the release's full name %q must be lower-case letters, digits and '-', a letter first (Service names are): change fullnameOverride or nameOverride" $full) }}
{{- end }}
{{- $full }}
{{- end }}

{{/* Refuses the names the values give that the API server would refuse (or, for gateway.name,
that make a Service it would refuse), and Secret keys no Secret holds (the kubelet would never
mount them), naming the value; an empty one takes the chart's default. */}}
{{- define "pd-extproc.checkNames" -}}
{{- $v := .Values }}
{{- $rows := list (list "serviceAccount.name" $v.serviceAccount.name "subdomain" 253)
      (list "tls.serverSecret" $v.tls.serverSecret "subdomain" 253)
      (list "tls.clientSecret" $v.tls.clientSecret "subdomain" 253)
      (list "engineAPIKey.secretName" $v.engineAPIKey.secretName "subdomain" 253)
      (list "engineCA.secretName" $v.engineCA.secretName "subdomain" 253) }}
{{- range $v.rbac.extraNamespaces }}
{{- $rows = append $rows (list "rbac.extraNamespaces" . "label" 63) }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $rows = append $rows (list (printf "config.pools.%s.kubernetes.namespace" $pool) (dig "pools" $pool "kubernetes" "namespace" "" $v.config) "label" 63) }}
{{- end }}
{{- range $key := list "engineAPIKey" "engineCA" }}
{{- with get $v $key }}
{{- if .secretName }}
{{- $rows = append $rows (list (printf "%s.key" $key) (required (printf "%s.key: the key of %s.secretName to mount" $key $key) .key) "secretKey" 253) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* The label app.kubernetes.io/name: whatever fullnameOverride is. */}}
{{- $rows = append $rows (list "nameOverride" (include "pd-extproc.name" .) "labelValue" 63) }}
{{- with $v.gateway }}
{{- if .enabled }}
{{- /* 56: the Service <name>-decode is an RFC 1035 label of at most 63 characters. */}}
{{- $rows = concat $rows (list (list "gateway.name" .name "service" 56)
      (list "gateway.className" .className "subdomain" 253)
      (list "gateway.proxyNamespace" .proxyNamespace "label" 63)
      (list "gateway.decodeService.namespace" .decodeService.namespace "label" 63)) }}
{{- end }}
{{- end }}
{{- $label := "[a-z0-9]|[a-z0-9][-a-z0-9]*[a-z0-9]" }}
{{- $rules := dict "label" (printf "^(%s)$" $label) "service" "^([a-z]|[a-z][-a-z0-9]*[a-z0-9])$" "subdomain" (printf "^(%s)(\\.(%s))*$" $label $label)
      "secretKey" "^[.]?[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"
      "labelValue" "^([A-Za-z0-9]|[A-Za-z0-9][-A-Za-z0-9_.]*[A-Za-z0-9])$" }}
{{- $says := dict "label" "a DNS label: lower-case letters, digits and '-', a letter or digit at each end"
      "service" "lower-case letters, digits and '-', a letter first and a letter or digit last: the Service <gateway.name>-decode is named after it"
      "subdomain" "a DNS subdomain: lower-case letters, digits, '-' and '.', a letter or digit at each end and beside each '.'"
      "secretKey" "a Secret's key: letters, digits, '-', '_' and '.', not '.' nor starting with '..'"
      "labelValue" "a label value: letters, digits, '-', '_' and '.', a letter or digit at each end (the label app.kubernetes.io/name is the name override, cut at 63)" }}
{{- range $rows }}
{{- $name := index . 1 | toString }}
{{- $rule := index . 2 }}
{{- if and (index . 1) (or (gt (len $name) (index . 3)) (not (regexMatch (get $rules $rule) $name))) }}
{{- fail (printf "%s: %q is not a name Kubernetes takes here: at most %d characters, %s" (index . 0) $name (index . 3) (get $says $rule)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object; the selector labels are a subset that never changes. */}}
{{- define "pd-extproc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pd-extproc
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{- define "pd-extproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{/* The standalone Envoy's pods: app.kubernetes.io/name envoy, as the engines' NetworkPolicy admits them. */}}
{{- define "pd-extproc.envoySelectorLabels" -}}
app.kubernetes.io/name: envoy
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{/* The pods a PodDisruptionBudget of minAvailable keeps out of replicas, as Kubernetes counts
them: a percentage is of the replicas, rounded up (pkg/controller/disruption). Takes (list
replicas minAvailable). */}}
{{- define "pd-extproc.pdbKeeps" -}}
{{- $replicas := int (index . 0) }}
{{- $min := toString (index . 1) }}
{{- if hasSuffix "%" $min }}
{{- div (add (mul $replicas (int (trimSuffix "%" $min))) 99) 100 }}
{{- else }}
{{- int $min }}
{{- end }}
{{- end }}

{{/* The bytes of a Kubernetes quantity, where Envoy's own config takes a number: a whole number
with an optional suffix Ki, Mi, Gi, k, M or G. Takes (list key quantity). */}}
{{- define "pd-extproc.bytes" -}}
{{- $q := index . 1 }}
{{- $q = ternary (int64 $q) $q (kindIs "float64" $q) | toString }}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 }}
{{- $unit := regexReplaceAll "^[0-9]+" $q "" }}
{{- if not (and (regexMatch "^[0-9]" $q) (hasKey $units $unit)) }}
{{- fail (printf "%s: %q is not a whole number of bytes with an optional suffix Ki, Mi, Gi, k, M or G" (index . 0) $q) }}
{{- end }}
{{- mul (trimSuffix $unit $q | int64) (get $units $unit) }}
{{- end }}

{{- define "pd-extproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pd-extproc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: the ServiceAccount to run as, when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The name Envoy checks in pd-extproc's certificate, and sends as SNI. */}}
{{- define "pd-extproc.serverName" -}}
{{ include "pd-extproc.fullname" . }}.{{ .Release.Namespace }}.svc
{{- end }}

{{- define "pd-extproc.clientSAN" -}}
{{ default (printf "envoy.%s" .Release.Namespace) .Values.tls.clientSAN }}
{{- end }}

{{- define "pd-extproc.serverSecret" -}}
{{ default (printf "%s-tls" (include "pd-extproc.fullname" .)) .Values.tls.serverSecret }}
{{- end }}

{{- define "pd-extproc.clientSecret" -}}
{{ default (printf "%s-client-tls" (include "pd-extproc.fullname" .)) .Values.tls.clientSecret }}
{{- end }}

{{- define "pd-extproc.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- /* Where the engines' API key is mounted (engineAPIKey). */}}
{{- define "pd-extproc.engineAPIKeyFile" -}}
/etc/pd-extproc-engine-key/api-key
{{- end }}

{{- /* Where the engines' CA bundle is mounted (engineCA). */}}
{{- define "pd-extproc.engineCAFile" -}}
/etc/pd-extproc-engine-ca/ca.crt
{{- end }}
