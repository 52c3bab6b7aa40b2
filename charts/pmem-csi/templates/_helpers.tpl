{{/* The prefix of every object name: the driver name with dots as dashes (PMEM-CSI 1.0's). */}}
{{- define "pmem-csi.prefix" -}}
{{ .Values.driverName | replace "." "-" }}
{{- end }}

{{/* The labels of every object: the ones kustomize adds to manifests/, and Helm's. */}}
{{- define "pmem-csi.labels" -}}
app.kubernetes.io/part-of: pmem-csi
app.kubernetes.io/instance: {{ .Values.driverName }}
{{ include "pmem-csi.helmLabels" . }}
{{- end }}

{{/* Helm's own labels (the comparison with kustomize ignores them). */}}
{{- define "pmem-csi.helmLabels" -}}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* The labels kustomize adds to pod templates. */}}
{{- define "pmem-csi.podLabels" -}}
app.kubernetes.io/part-of: pmem-csi
app.kubernetes.io/instance: {{ .Values.driverName }}
{{- end }}

{{/* An image reference from repository, tag and digest (the digest wins). */}}
{{- define "pmem-csi.image" -}}
{{- if .digest }}{{ .repository }}@{{ .digest }}{{ else }}{{ .repository }}:{{ .tag }}{{ end }}
{{- end }}

{{/* --node-selector as the three programs take it: k=v[,k=v], keys sorted. */}}
{{- define "pmem-csi.nodeSelectorFlag" -}}
{{- $pairs := list }}
{{- range $k, $v := .Values.nodeSelector }}{{ $pairs = append $pairs (printf "%s=%s" $k $v) }}{{ end }}
{{- join "," $pairs }}
{{- end }}

{{/* Fails the render on values that cannot work, naming the value. */}}
{{- define "pmem-csi.validate" -}}
{{- if not (has .Values.deviceMode (list "emulated" "lvm" "direct")) }}
{{- fail (printf "deviceMode: %q is not one of emulated, lvm, direct" .Values.deviceMode) }}
{{- end }}
{{- if not (has .Values.webhook.certificates (list "selfSigned" "certManager" "existingSecret")) }}
{{- fail (printf "webhook.certificates: %q is not one of selfSigned, certManager, existingSecret" .Values.webhook.certificates) }}
{{- end }}
{{- if and .Values.schedulerExtender.enabled (eq .Values.webhook.certificates "existingSecret") (or (not .Values.webhook.existingSecret) (not .Values.webhook.caBundle)) }}
{{- fail "webhook.existingSecret and webhook.caBundle: both are needed with webhook.certificates=existingSecret" }}
{{- end }}
{{- if empty .Values.nodeSelector }}
{{- fail "nodeSelector: must not be empty (it tells nodes meant to run the driver from the others)" }}
{{- end }}
{{- end }}
