{{/* Names, labels and the few values every template shares. */}}

{{- define "radixserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release name when it already says "radixserve", else <release>-radixserve. */}}
{{- define "radixserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "radixserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "radixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "frontend"). */}}
{{- define "radixserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "radixserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "radixserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image reference: call with (dict "ctx" $ "image" .Values.images.worker). */}}
{{- define "radixserve.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "radixserve.engineHeadless" -}}
{{- printf "%s-engine-headless" (include "radixserve.fullname" .) -}}
{{- end -}}

{{/* host names of every engine replica, comma separated, no port. */}}
{{- define "radixserve.engineHosts" -}}
{{- $full := include "radixserve.fullname" . -}}
{{- $svc := include "radixserve.engineHeadless" . -}}
{{- $hosts := list -}}
{{- range $i := until (int .Values.engine.replicas) -}}
{{- $hosts = append $hosts (printf "%s-engine-%d.%s.%s.svc.%s" $full $i $svc $.Release.Namespace $.Values.clusterDomain) -}}
{{- end -}}
{{- join "," $hosts -}}
{{- end -}}

{{- define "radixserve.modelPath" -}}
{{- if eq .Values.model.source "image" -}}
/opt/radixserve/models/radixserve-zen
{{- else -}}
{{- printf "/models/%s" (trimPrefix "/" .Values.model.path) -}}
{{- end -}}
{{- end -}}

{{- define "radixserve.modelClaim" -}}
{{- default (printf "%s-models" (include "radixserve.fullname" .)) .Values.model.pvc.existingClaim -}}
{{- end -}}

{{- define "radixserve.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint -}}
{{- .Values.tracing.otlpEndpoint -}}
{{- else if .Values.tracing.jaeger.enabled -}}
{{- printf "%s-jaeger.%s.svc.%s:4317" (include "radixserve.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}
{{- end -}}

{{/*
One value as a RADIXSERVE_* environment variable: lists comma separated, bools true/false,
whole numbers without an exponent (values arrive as float64, and 1000000 would print 1e+06).
*/}}
{{- define "radixserve.envValue" -}}
{{- if kindIs "slice" . -}}
{{- join "," . -}}
{{- else if kindIs "bool" . -}}
{{- ternary "true" "false" . -}}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) -}}
{{- if eq (float64 .) (floor .) -}}{{- int64 . -}}{{- else -}}{{- . -}}{{- end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* Volumes that hold the model, the HF cache, /dev/shm and the writable scratch dirs. */}}
{{- define "radixserve.modelVolumes" -}}
{{- if eq .Values.model.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "radixserve.modelClaim" . }}
    readOnly: true
{{- end }}
{{- if .Values.model.hfCache.enabled }}
- name: hf-cache
  {{- if .Values.model.hfCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.hfCache.existingClaim }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
- name: home
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "radixserve.modelMounts" -}}
{{- if eq .Values.model.source "pvc" }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- if .Values.model.hfCache.enabled }}
- name: hf-cache
  mountPath: {{ .Values.model.hfCache.mountPath }}
{{- end }}
- name: home
  mountPath: /home/radixserve
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* The gRPC health probes of one container: (dict "port" N "startup" .Values.x.startupProbe). */}}
{{- define "radixserve.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
  timeoutSeconds: 5
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 10
  failureThreshold: 3
  timeoutSeconds: 5
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 15
  failureThreshold: 4
  timeoutSeconds: 5
{{- end -}}
