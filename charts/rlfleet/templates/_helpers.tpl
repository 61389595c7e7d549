{{/* Chart name, truncated to a DNS label. */}}
{{- define "rlfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects. */}}
{{- define "rlfleet.fullname" -}}
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

{{- define "rlfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "rlfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rlfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlfleet
{{- end }}

{{- define "rlfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rlfleet.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* true when the operator serves every namespace (cluster-scoped RBAC and peering). */}}
{{- define "rlfleet.clusterwide" -}}
{{- if empty .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{/* Where the operator reads the accelerator catalog override (rlfleet.catalog.CATALOG_ENV). */}}
{{- define "rlfleet.catalogDir" -}}/etc/rlfleet/catalog{{- end }}

{{/* The admission webhook's objects (templates/webhook.yaml). The configuration is cluster-scoped:
its name carries the release namespace, so releases of one name in two namespaces do not clash. */}}
{{- define "rlfleet.webhookService" -}}{{ include "rlfleet.fullname" . }}-webhook{{- end }}
{{- define "rlfleet.webhookSecret" -}}{{ include "rlfleet.fullname" . }}-webhook-cert{{- end }}
{{- define "rlfleet.webhookConfiguration" -}}
{{- printf "%s-%s" (include "rlfleet.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" }}
{{- end }}
{{- define "rlfleet.webhookCertDir" -}}/etc/rlfleet/webhook{{- end }}

{{/* The sandbox role (operator/sandboxes.py SANDBOX_RULES) the operator binds a job's trainer to when its
sandboxes are pods: a ClusterRole in cluster mode (named with the release namespace: cluster-scoped), a
Role of each watched namespace in namespace mode. RLFLEET_SANDBOX_ROLE is "<Kind>/<name>". */}}
{{- define "rlfleet.sandboxRole" -}}
{{- if include "rlfleet.clusterwide" . -}}
{{- printf "%s-%s-sandboxes" (include "rlfleet.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" -}}
{{- else -}}
{{- include "rlfleet.fullname" . }}-sandboxes
{{- end -}}
{{- end }}
{{- define "rlfleet.sandboxRoleRef" -}}
{{- if include "rlfleet.clusterwide" . }}ClusterRole{{ else }}Role{{ end }}/{{ include "rlfleet.sandboxRole" . }}
{{- end }}
{{/* The agent-sandbox role (operator/sandboxes.py AGENT_SANDBOX_RULES) the operator binds a job's trainer to
when its sandboxes are agent-sandbox's SandboxClaims: named and scoped as the sandbox role.
RLFLEET_AGENT_SANDBOX_ROLE is "<Kind>/<name>". */}}
{{- define "rlfleet.agentSandboxRole" -}}
{{- if include "rlfleet.clusterwide" . -}}
{{- printf "%s-%s-agent-sandboxes" (include "rlfleet.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" -}}
{{- else -}}
{{- include "rlfleet.fullname" . }}-agent-sandboxes
{{- end -}}
{{- end }}
{{- define "rlfleet.agentSandboxRoleRef" -}}
{{- if include "rlfleet.clusterwide" . }}ClusterRole{{ else }}Role{{ end }}/{{ include "rlfleet.agentSandboxRole" . }}
{{- end }}
