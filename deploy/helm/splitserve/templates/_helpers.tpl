{{/*
Names. Resource names are "<fullname>-<component>"; fullname is capped so that
the longest suffix (a worker group's name) still fits a 63-character DNS label.
*/}}
{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every resource. */}}
{{- define "splitserve.labels" -}}
helm.sh/chart: {{ include "splitserve.chart" . }}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "router"). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.componentLabels" -}}
{{ include "splitserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Images: call with (dict "root" $ "flavor" "slim"|"cuda"). */}}
{{- define "splitserve.image" -}}
{{- $image := index .root.Values.images .flavor -}}
{{- $tag := $image.tag | default (printf "%s-%s" .root.Chart.AppVersion .flavor) -}}
{{- printf "%s:%s" $image.repository $tag -}}
{{- end -}}

{{/*
The --inference-shards spec, rendered from .Values.inferenceShards in order:
"tp=2,pp=1,dp=1,role=prefill+tp=1,pp=1,dp=2,role=decode".
*/}}
{{- define "splitserve.inferenceShards" -}}
{{- $groups := list -}}
{{- range $index, $group := .Values.inferenceShards -}}
{{- $groups = append $groups (printf "tp=%d,pp=%d,dp=%d,role=%s" (int (default 1 $group.tp)) (int (default 1 $group.pp)) (int (default 1 $group.dp)) $group.role) -}}
{{- end -}}
{{- join "+" $groups -}}
{{- end -}}

{{/* A shard group's name: its `name`, or "<role>-<index>". Call with (list $index $group). */}}
{{- define "splitserve.groupName" -}}
{{- $index := index . 0 -}}
{{- $group := index . 1 -}}
{{- $group.name | default (printf "%s-%d" $group.role $index) -}}
{{- end -}}

{{/* HOST:PORT of etcd: the release's own client Service, or the external endpoint. */}}
{{- define "splitserve.etcdEndpoint" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s-etcd.%s.svc:%d" (include "splitserve.fullname" .) .Release.Namespace (int .Values.etcd.clientPort) -}}
{{- else -}}
{{- required "etcd.external.endpoint (HOST:PORT) is required when etcd.enabled is false" .Values.etcd.external.endpoint -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.etcdAuthSecret" -}}
{{- .Values.etcd.auth.existingSecret | default (printf "%s-etcd-auth" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{- define "splitserve.etcdScheme" -}}
{{- if .Values.etcd.tls.enabled -}}https{{- else -}}http{{- end -}}
{{- end -}}

{{/*
Environment every splitserve container gets: its pod's identity (the downward
API; $(POD_IP) in args expands from it), etcd client credentials, and the OTel
resource attributes. Call with (dict "root" $ "component" "router").
*/}}
{{- define "splitserve.commonEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: OTEL_SERVICE_NAME
  value: splitserve-{{ .component }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ include "splitserve.otelResourceAttributes" . | quote }}
{{- if .root.Values.etcd.auth.enabled }}
- name: SPLITSERVE_ETCD_USERNAME
  value: root
- name: SPLITSERVE_ETCD_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ include "splitserve.etcdAuthSecret" .root }}, key: root-password}}
{{- end }}
{{- if .root.Values.etcd.tls.enabled }}
- name: SPLITSERVE_ETCD_CA_FILE
  value: /etc/splitserve/etcd-tls/ca.crt
- name: SPLITSERVE_ETCD_CERT_FILE
  value: /etc/splitserve/etcd-tls/tls.crt
- name: SPLITSERVE_ETCD_KEY_FILE
  value: /etc/splitserve/etcd-tls/tls.key
{{- end }}
{{- end -}}

{{- define "splitserve.otelResourceAttributes" -}}
{{- $attrs := list (printf "service.namespace=%s" .root.Release.Name) (printf "service.version=%s" .root.Chart.AppVersion) "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "k8s.node.name=$(NODE_NAME)" (printf "splitserve.component=%s" .component) -}}
{{- range $key, $value := .root.Values.otel.resourceAttributes -}}
{{- $attrs = append $attrs (printf "%s=%s" $key (toString $value)) -}}
{{- end -}}
{{- join "," $attrs -}}
{{- end -}}

{{/* The etcd client TLS volume (when etcd.tls.enabled): call with the root context. */}}
{{- define "splitserve.etcdTlsVolume" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ required "etcd.tls.existingSecret is required when etcd.tls.enabled" .Values.etcd.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "splitserve.etcdTlsVolumeMount" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: /etc/splitserve/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The model volume (when model.volume is set), mounted read-only. */}}
{{- define "splitserve.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "splitserve.modelVolumeMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
gRPC probes on the standard grpc.health.v1 service (""), which every splitserve
server marks NOT_SERVING as it starts draining. Call with (dict "port" N "probe" {...}).
*/}}
{{- define "splitserve.grpcProbe" -}}
grpc:
  port: {{ .port }}
{{- with .probe }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The annotation that rolls every pod when the shared config changes. */}}
{{- define "splitserve.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{/*
A PodDisruptionBudget: call with (dict "root" $ "name" NAME "component" C "pdb" {...}
"selector" (extra selector labels, optional)).
*/}}
{{- define "splitserve.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "splitserve.componentLabels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  {{- if hasKey .pdb "minAvailable" }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
      {{- with .selector }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
{{- end }}
{{- end -}}

{{/* Settings shared by the etcdctl containers of the auth Job (environment, TLS, security). */}}
{{- define "splitserve.etcdctlContainer" -}}
env:
  - name: ETCDCTL_API
    value: "3"
  - name: ETCDCTL_ENDPOINTS
    value: {{ .endpoint | quote }}
  - name: ETCDCTL_DIAL_TIMEOUT
    value: 10s
  - name: ROOT_PASSWORD
    valueFrom: {secretKeyRef: {name: {{ .secret }}, key: root-password}}
  {{- if .root.Values.etcd.tls.enabled }}
  - name: ETCDCTL_CACERT
    value: /etc/splitserve/etcd-tls/ca.crt
  - name: ETCDCTL_CERT
    value: /etc/splitserve/etcd-tls/tls.crt
  - name: ETCDCTL_KEY
    value: /etc/splitserve/etcd-tls/tls.key
  {{- end }}
securityContext:
  {{- toYaml .root.Values.securityContext | nindent 2 }}
resources:
  requests: {cpu: 10m, memory: 32Mi}
  limits: {memory: 64Mi}
{{- if .root.Values.etcd.tls.enabled }}
volumeMounts:
  - name: etcd-tls
    mountPath: /etc/splitserve/etcd-tls
    readOnly: true
{{- end }}
{{- end -}}
