{{/* Names, labels and the few values every template shares. */}}

{{- define "radixserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release name when it already says "radixserve", else <release>-radixserve; at most 42
characters, so the longest derived names fit in a 63-character DNS label:
<fullname>-engine-headless (+16), models-<fullname>-engine-<ordinal> (+15 up to ordinal 99),
and the StatefulSet's controller-revision-hash label <fullname>-engine-<10 chars> (+18).
*/}}
{{- define "radixserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 42 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 42 | trimSuffix "-" -}}
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

{{/*
Labels of a pod template: the selector's plus version and podLabels, but not helm.sh/chart,
so that a chart version bump alone never restarts pods (GPU engines reload their model).
Call with (dict "ctx" $ "component" "engine" "extra" .Values.engine.podLabels).
*/}}
{{- define "radixserve.podLabels" -}}
{{ include "radixserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
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

{{/* The DNS name whose A records are every engine pod (what frontends re-resolve). */}}
{{- define "radixserve.engineDnsName" -}}
{{- printf "%s.%s.svc.%s" (include "radixserve.engineHeadless" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/*
Which ConfigMap a `config` key goes to: keys of frontend-only flags to the frontend's, the
shared ones to both, every other key (scheduler and worker flags) to the engines'.
tests/deploy/test_helm_chart.py checks these lists against services/common/config.py.
*/}}
{{- define "radixserve.frontendOnlyKeys" -}}
maxModelLen maxRequestBytes requestBodyTimeout engineResolveInterval engineDnsServer routingPolicy routingLoadFactor routingBalanceAbsThreshold routingBalanceRelThreshold routingMinMatchTokens routingLoadCostTokens routingHotPrefixForks toolCallParser reasoningParser metricsAuth maxConcurrentRequestsPerKey
{{- end -}}
{{- define "radixserve.sharedKeys" -}}
logLevel shutdownGracePeriod
{{- end -}}

{{/* The RuntimeClass of engine pods: "auto" is nvidia in device-plugin mode. */}}
{{- define "radixserve.runtimeClassName" -}}
{{- $rc := .Values.engine.runtimeClassName -}}
{{- if eq $rc "auto" -}}
{{- if eq .Values.gpu.mode "device-plugin" -}}nvidia{{- end -}}
{{- else -}}
{{- $rc -}}
{{- end -}}
{{- end -}}

{{/* The spec of the engines' GPU claim (gpu.mode=dra). */}}
{{- define "radixserve.gpuClaimSpec" -}}
devices:
  requests:
    - name: gpu
      exactly:
        deviceClassName: {{ .Values.gpu.dra.deviceClassName }}
        allocationMode: ExactCount
        count: {{ .Values.gpu.count }}
        {{- with .Values.gpu.dra.selectors }}
        selectors:
          {{- range . }}
          - cel:
              expression: {{ . | quote }}
          {{- end }}
        {{- end }}
{{- end -}}

{{/*
A ResourceClaimTemplate's spec is immutable: its name carries a hash of the spec, so an
upgrade that changes the spec creates a new template (and rolls the engines onto it) instead
of failing on an update Kubernetes refuses.
*/}}
{{- define "radixserve.gpuClaimName" -}}
{{- printf "%s-gpu-%s" (include "radixserve.fullname" .) (include "radixserve.gpuClaimSpec" . | sha256sum | trunc 8) -}}
{{- end -}}

{{/* Whether the frontend downloads its tokenizer from the Hub rather than mounting the PVC. */}}
{{- define "radixserve.frontendDownloads" -}}
{{- if or (eq .Values.model.source "hf") (and (eq .Values.model.source "pvc") .Values.model.hf.repo) -}}true{{- end -}}
{{- end -}}

{{/* Where the model folder is; with source hf, /models/<repo name> (model.path is for pvc). */}}
{{- define "radixserve.modelPath" -}}
{{- if eq .Values.model.source "image" -}}
/opt/radixserve/models/radixserve-zen
{{- else if eq .Values.model.source "hf" -}}
{{- printf "/models/%s" (.Values.model.hf.repo | splitList "/" | last) -}}
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

{{/*
Volumes that hold the model, the HF cache and the writable scratch dirs; call with
(dict "ctx" $ "component" "engine"|"frontend"). The engines' hf download lives in their
volumeClaimTemplate (storage pvc) or an emptyDir; the frontend's tokenizer in an emptyDir.
*/}}
{{- define "radixserve.modelVolumes" -}}
{{- $v := .ctx.Values -}}
{{- $download := or (eq $v.model.source "hf") (and (eq .component "frontend") (include "radixserve.frontendDownloads" .ctx)) -}}
{{- if $download }}
{{- if or (eq .component "frontend") (eq $v.model.hf.storage "emptyDir") }}
- name: models
  emptyDir: {}
{{- end }}
- name: fetch-model
  configMap:
    name: {{ include "radixserve.fullname" .ctx }}-fetch-model
{{- else if eq $v.model.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "radixserve.modelClaim" .ctx }}
    readOnly: true
{{- end }}
{{- if $v.model.hfCache.enabled }}
- name: hf-cache
  {{- if $v.model.hfCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $v.model.hfCache.existingClaim }}
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
{{- if ne .Values.model.source "image" }}
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

{{/*
The gRPC health probes of one container: (dict "port" N "startup" .Values.x.startupProbe),
plus "ready" and "live", the health service names that readiness and startup/liveness ask
("" when absent: the server's overall status).
*/}}
{{- define "radixserve.grpcProbes" -}}
startupProbe:
  grpc: {port: {{ .port }}{{ with .live }}, service: {{ . }}{{ end }}}
  periodSeconds: {{ .startup.periodSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
  timeoutSeconds: 5
readinessProbe:
  grpc: {port: {{ .port }}{{ with .ready }}, service: {{ . }}{{ end }}}
  periodSeconds: 5
  failureThreshold: 2
  timeoutSeconds: 5
livenessProbe:
  grpc: {port: {{ .port }}{{ with .live }}, service: {{ . }}{{ end }}}
  periodSeconds: 15
  failureThreshold: 4
  timeoutSeconds: 5
{{- end -}}

{{/*
The init container that downloads the model (engines) or only its tokenizer files (frontend)
from the Hugging Face Hub into /models/<path>, skipping what is already there.
Call with (dict "ctx" $ "image" .Values.images.worker "tokenizerOnly" true|false).
*/}}
{{- define "radixserve.fetchModel" -}}
{{- $v := .ctx.Values -}}
- name: fetch-model
  image: {{ include "radixserve.image" (dict "ctx" .ctx "image" .image) }}
  imagePullPolicy: {{ .image.pullPolicy }}
  command: [python, /fetch/fetch_model.py]
  args:
    - --repo={{ required "model.hf.repo is required with model.source=hf" $v.model.hf.repo }}
    - --revision={{ $v.model.hf.revision }}
    - --dest={{ include "radixserve.modelPath" .ctx }}
    {{- if .tokenizerOnly }}
    - --tokenizer-only
    {{- end }}
  env:
    - {name: HF_HOME, value: /tmp/hf-home}
    - {name: HF_HUB_DISABLE_TELEMETRY, value: "1"}
    {{- with $v.model.hf.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ . }}, key: {{ $v.model.hf.tokenSecretKey }}}
    {{- end }}
  resources:
    {{- toYaml $v.model.hf.resources | nindent 4 }}
  securityContext:
    {{- toYaml $v.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: /models}
    - {name: fetch-model, mountPath: /fetch, readOnly: true}
    - {name: tmp, mountPath: /tmp}
{{- end -}}

{{/* The RADIXSERVE_* variables of one component: (dict "ctx" $ "component" "frontend"). */}}
{{- define "radixserve.componentConfig" -}}
{{- $v := .ctx.Values -}}
{{- $frontOnly := splitList " " (include "radixserve.frontendOnlyKeys" .ctx) -}}
{{- $shared := splitList " " (include "radixserve.sharedKeys" .ctx) -}}
RADIXSERVE_ENABLE_METRICS: {{ ternary "true" "false" $v.metrics.enabled | quote }}
RADIXSERVE_OTLP_TRACES_ENDPOINT: {{ include "radixserve.otlpEndpoint" .ctx | quote }}
{{- with $v.model.servedName }}
RADIXSERVE_SERVED_MODEL_NAME: {{ . | quote }}
{{- end }}
{{- range $key, $value := $v.config }}
{{- $wanted := or (has $key $shared) (eq (has $key $frontOnly) (eq $.component "frontend")) }}
{{- if and $wanted (not (kindIs "invalid" $value)) }}
RADIXSERVE_{{ snakecase $key | upper }}: {{ include "radixserve.envValue" $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secret holding the API key(s): the user's or the chart's. */}}
{{- define "radixserve.apiKeySecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-api-key" (include "radixserve.fullname" .)) -}}
{{- end -}}

{{/* The Secret holding the internal links' keys: the user's or the chart's (a seed). */}}
{{- define "radixserve.internalKeysSecret" -}}
{{- .Values.internalAuth.existingSecret | default (printf "%s-internal-keys" (include "radixserve.fullname" .)) -}}
{{- end -}}

{{/*
The keys volume of one pod: (dict "ctx" $ "component" "engine"|"frontend"). A user-made
Secret (`radixserve keys generate`) gives each pod only its files: a frontend gets its own
secret key, the scheduler's public key and the control token, never an engine's secret key.
*/}}
{{- define "radixserve.internalKeysVolume" -}}
- name: internal-keys
  secret:
    secretName: {{ include "radixserve.internalKeysSecret" .ctx }}
    defaultMode: 0440
    items:
      {{- if not .ctx.Values.internalAuth.existingSecret }}
      - {key: seed, path: seed}
      {{- else if eq .component "frontend" }}
      {{- range list "frontend.key_secret" "scheduler.key" "control.token" }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
      {{- else }}
      {{- range list "scheduler.key_secret" "scheduler.key" "worker.key_secret" "worker.key" "frontend.key" "control.token" }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
      {{- end }}
{{- end -}}

{{/* The Secret of the shared KV store (engine.sharedKVStore): the user's or the chart's. */}}
{{- define "radixserve.kvStoreSecret" -}}
{{- $s := .Values.engine.sharedKVStore -}}
{{- if $s.deploy -}}
{{- printf "%s-kvstore" (include "radixserve.fullname" .) -}}
{{- else -}}
{{- required "engine.sharedKVStore.existingSecret is required with engine.sharedKVStore.deploy=false: a Secret with key url (and optionally password)" $s.existingSecret -}}
{{- end -}}
{{- end -}}

{{/*
The worker's --hicache-storage-url and --hicache-storage-password, from the shared KV
store's Secret: never in argv (ps shows it) or a ConfigMap. A user's Secret may leave the
password out (the URL holds it, or the server takes none).
*/}}
{{- define "radixserve.kvStoreEnv" -}}
{{- $name := include "radixserve.kvStoreSecret" . -}}
- name: RADIXSERVE_HICACHE_STORAGE_URL
  valueFrom:
    secretKeyRef: {name: {{ $name }}, key: url}
- name: RADIXSERVE_HICACHE_STORAGE_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $name }}, key: password{{ if not .Values.engine.sharedKVStore.deploy }}, optional: true{{ end }}}
{{- end -}}

{{/* The pod's own IP (downward API): internal ports bind it, not every interface. */}}
{{- define "radixserve.podIpEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end -}}

{{/* The API key(s) of the frontend and of `helm test`, from their Secret. */}}
{{- define "radixserve.apiKeyEnv" -}}
{{- if .Values.auth.enabled }}
- name: RADIXSERVE_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "radixserve.apiKeySecret" . }}, key: {{ .Values.auth.secretKey }}}
{{- end }}
{{- end -}}
