{{/* The chart's name, and the release's full name (Kubernetes names are at most 63 bytes). */}}
{{- define "pd-extproc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pd-extproc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
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
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The standalone Envoy's pods: app.kubernetes.io/name envoy, as the engines' NetworkPolicy admits them. */}}
{{- define "pd-extproc.envoySelectorLabels" -}}
app.kubernetes.io/name: envoy
app.kubernetes.io/instance: {{ .Release.Name }}
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
