{{- define "rlstream.fullname" -}}
{{- printf "%s-rlstream" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlstream.labels" -}}
app.kubernetes.io/name: rlstream
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rlstream.selector" -}}
app.kubernetes.io/name: rlstream
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "rlstream.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "rlstream.dataClaim" -}}
{{ .Values.storage.existingClaim | default (printf "%s-data" (include "rlstream.fullname" .)) }}
{{- end -}}

{{/* security.protocol from the sasl/tls switches */}}
{{- define "rlstream.securityProtocol" -}}
{{- if and .Values.kafka.sasl.enabled .Values.kafka.tls.enabled -}}SASL_SSL
{{- else if .Values.kafka.sasl.enabled -}}SASL_PLAINTEXT
{{- else if .Values.kafka.tls.enabled -}}SSL
{{- else -}}PLAINTEXT
{{- end -}}
{{- end -}}

{{/* kafka.common as one TOML inline table (RLSTREAM_KAFKA__COMMON); the password is expanded by
     Kubernetes from KAFKA_SASL_PASSWORD, which is not an RLSTREAM_* variable. */}}
{{- define "rlstream.kafkaCommon" -}}
{{- $s := dict "security.protocol" (include "rlstream.securityProtocol" .) -}}
{{- if .Values.kafka.sasl.enabled -}}
{{- $_ := set $s "sasl.mechanism" .Values.kafka.sasl.mechanism -}}
{{- $_ := set $s "sasl.username" .Values.kafka.sasl.username -}}
{{- $_ := set $s "sasl.password" "$(KAFKA_SASL_PASSWORD)" -}}
{{- end -}}
{{- if .Values.kafka.tls.enabled -}}
{{- $_ := set $s "ssl.ca.location" (printf "/etc/rlstream/kafka-ca/%s" .Values.kafka.tls.caSecret.key) -}}
{{- end -}}
{{- $s = merge (deepCopy .Values.kafka.common) $s -}}
{ {{- range $i, $k := keys $s | sortAlpha }}{{ if $i }}, {{ end }}{{ toJson $k }} = {{ toJson (get $s $k) }}{{ end -}} }
{{- end -}}

{{/* Environment of every rlstream container (the job config itself is given with --config). */}}
{{- define "rlstream.env" -}}
- name: RLSTREAM_KAFKA__BOOTSTRAP_SERVERS
  value: {{ .Values.kafka.bootstrapServers | quote }}
# pods may start before the cluster answers: wait for it (liveness.startup_timeout_s), do not stop after 5 s
- name: RLSTREAM_LIVENESS__BROKER_CHECK_S
  value: "0"
- name: RLSTREAM_TOPICS__PREFIX
  value: {{ .Values.topicPrefix | quote }}
- name: RLSTREAM_ROLLOUT__GROUP_ID
  value: {{ .Values.groups.rollout | quote }}
- name: RLSTREAM_REWARD__GROUP_ID
  value: {{ .Values.groups.reward | quote }}
{{- if .Values.kafka.sasl.enabled }}
- name: KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.sasl.passwordSecret.name is required with SASL" .Values.kafka.sasl.passwordSecret.name }}
      key: {{ .Values.kafka.sasl.passwordSecret.key }}
{{- end }}
- name: RLSTREAM_KAFKA__COMMON
  value: {{ include "rlstream.kafkaCommon" . | quote }}
{{- end -}}

{{- define "rlstream.volumeMounts" -}}
- name: config
  mountPath: /etc/rlstream
  readOnly: true
- name: data
  mountPath: /data
{{- if .Values.kafka.tls.enabled }}
- name: kafka-ca
  mountPath: /etc/rlstream/kafka-ca
  readOnly: true
{{- end }}
{{- end -}}

{{- define "rlstream.volumes" -}}
- name: config
  configMap:
    name: {{ include "rlstream.fullname" . }}
- name: data
  persistentVolumeClaim:
    claimName: {{ include "rlstream.dataClaim" . }}
{{- if .Values.kafka.tls.enabled }}
- name: kafka-ca
  secret:
    secretName: {{ required "kafka.tls.caSecret.name is required with TLS" .Values.kafka.tls.caSecret.name }}
    items:
      - key: {{ .Values.kafka.tls.caSecret.key }}
        path: {{ .Values.kafka.tls.caSecret.key }}
{{- end }}
{{- end -}}

{{/* Prometheus scrape annotations for a role's pods. */}}
{{- define "rlstream.scrape" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ . | quote }}
prometheus.io/path: /metrics
{{- end -}}
