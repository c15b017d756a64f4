{{- define "tessera.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tessera.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tessera.labels" -}}
{{ include "tessera.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tessera.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tessera.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tessera.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The namespaces the operator watches unless clusterWide: watchNamespaces, else the release's own.
A JSON list (templates return strings): `include ... | fromJsonArray`.
*/}}
{{- define "tessera.watchedNamespaces" -}}
{{- if and .Values.clusterWide .Values.watchNamespaces -}}
{{- fail "set clusterWide or watchNamespaces, not both" -}}
{{- end -}}
{{- default (list .Release.Namespace) .Values.watchNamespaces | toJson -}}
{{- end -}}

{{/*
The operator's permissions: exactly the calls it makes (tests/operator/test_rbac.py runs every
reconcile path against a recording fake and compares).
- inferenceservices: kopf lists/watches them and patches its annotations; status via the subresource.
- owned objects: server-side apply (create + patch); list + delete to prune what a spec no longer
  needs, on the kinds that come and go with it (Deployments, Services, NetworkPolicies; kube.PRUNED_KINDS);
  get on Deployments to read their ready replicas.
- secrets: get (does NAME-internal exist?) and create (it once, with a random value). Never list,
  patch or delete: the operator writes no other Secret and reads none.
- pods: list, to count ready and pending engine pods and find their metrics endpoints.
- endpointslices: read-only, held so the operator may grant it to each gateway's Role (RBAC forbids
  granting what one does not hold).
- events: kopf posts scaling decisions and errors.
*/}}
{{- define "tessera.rules" -}}
- apiGroups: ["tessera.dev"]
  resources: ["inferenceservices"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["tessera.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "create", "patch", "delete"]
# Pipeline-parallel pools; the LeaderWorkerSet controller (not part of this chart) serves the kind.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts"]
  verbs: ["create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{- define "tessera.monitoringLabels" -}}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: monitoring
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
The namespaces where InferenceServices' pods run, as a monitor's namespaceSelector.
*/}}
{{- define "tessera.monitoredNamespaces" -}}
{{- if .Values.clusterWide -}}
any: true
{{- else -}}
matchNames:
{{- range (include "tessera.watchedNamespaces" . | fromJsonArray) }}
  - {{ . }}
{{- end }}
{{- end -}}
{{- end -}}
