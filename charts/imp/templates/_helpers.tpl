{{/*
Labels every object carries.
*/}}
{{- define "imp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: imp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: imp
{{- end }}

{{/*
Selector labels of one component: (dict "root" $ "component" "operator").
*/}}
{{- define "imp.selectorLabels" -}}
app.kubernetes.io/name: imp
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Labels of one component's objects: (dict "root" $ "component" "operator").
*/}}
{{- define "imp.componentLabels" -}}
{{ include "imp.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
A component's image reference: (dict "root" $ "image" .Values.operator.image).
*/}}
{{- define "imp.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end }}

{{/*
A component's RUST_LOG: its own logLevel, else the global one.
*/}}
{{- define "imp.logLevel" -}}
{{- default .root.Values.logLevel .component.logLevel -}}
{{- end }}

{{/*
The webhook's DNS names, as the API server calls it.
*/}}
{{- define "imp.webhookDNSNames" -}}
- imp-webhook.{{ .Release.Namespace }}.svc
- imp-webhook.{{ .Release.Namespace }}.svc.cluster.local
{{- end }}

{{/*
The documents of a file of files/rbac/ as a list of objects (comments dropped; the files stay
plain YAML, several documents separated by `---` lines).
*/}}
{{- define "imp.rbacDocuments" -}}
{{- $docs := list -}}
{{- range $doc := regexSplit "(?m)^---[ \t]*$" (.root.Files.Get .file) -1 -}}
{{- $obj := fromYaml $doc -}}
{{- if hasKey $obj "Error" -}}
{{- fail (printf "%s: %s" $.file (get $obj "Error")) -}}
{{- end -}}
{{- if $obj.kind -}}
{{- $docs = append $docs $obj -}}
{{- end -}}
{{- end -}}
{{- toJson $docs -}}
{{- end }}
