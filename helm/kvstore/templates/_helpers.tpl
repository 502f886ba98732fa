{{/* Names and labels. */}}
{{- define "kvstore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvstore.fullname" -}}
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

{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvstore.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvstore.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvstore
{{- end -}}

{{/* Labels of one component: (dict "ctx" $ "component" "node") */}}
{{- define "kvstore.componentLabels" -}}
{{ include "kvstore.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvstore.componentSelector" -}}
{{ include "kvstore.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvstore.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Cache nodes without GPUs may run the slim CPU build. */}}
{{- define "kvstore.nodeImage" -}}
{{- if and (eq (int .Values.node.gpu.count) 0) .Values.image.cpuTag -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.cpuTag -}}
{{- else -}}
{{- include "kvstore.image" . -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.nodeService" -}}{{ include "kvstore.fullname" . }}-node{{- end -}}
{{- define "kvstore.redisService" -}}{{ include "kvstore.fullname" . }}-redis{{- end -}}
{{- define "kvstore.rayClusterName" -}}{{ include "kvstore.fullname" . }}-ray{{- end -}}

{{/*
Bytes of a Kubernetes quantity (Ki Mi Gi Ti k M G T or none), as a float64 string. The same units as
kvstore.node.config.parse_size, so the chart and the node agree on every budget. A number given unquoted in
YAML arrives as a float64 and is taken as bytes.
*/}}
{{- define "kvstore.bytes" -}}
{{- $v := .value -}}
{{- if or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- printf "%.0f" (float64 $v) -}}
{{- else -}}
{{- $s := toString $v | trim -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $s -}}
{{- $unit := trimPrefix $num $s -}}
{{- $mult := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 -}}
{{- if or (not $num) (not (hasKey $mult $unit)) -}}
{{- fail (printf "%s: %q is not a size (examples: 4096, 512Mi, 64Gi, 1Ti)" .name $s) -}}
{{- end -}}
{{- printf "%.0f" (mulf (float64 $num) (get $mult $unit)) -}}
{{- end -}}
{{- end -}}

{{/* A byte count rendered as a Kubernetes quantity in whole MiB, rounded up. */}}
{{- define "kvstore.mib" -}}
{{- printf "%.0fMi" (ceil (divf (float64 .) 1048576.0)) -}}
{{- end -}}

{{/* Memory request/limit of a cache node: DRAM slab + overhead. */}}
{{- define "kvstore.nodeMemoryBytes" -}}
{{- $dram := include "kvstore.bytes" (dict "name" "node.budgets.dram" "value" .Values.node.budgets.dram) | float64 -}}
{{- $over := include "kvstore.bytes" (dict "name" "node.memoryOverhead" "value" .Values.node.memoryOverhead) | float64 -}}
{{- printf "%.0f" (addf $dram $over) -}}
{{- end -}}

{{- define "kvstore.terminationGrace" -}}
{{- add (ceil .Values.node.shutdown.drainSeconds) (ceil .Values.node.shutdown.spillSeconds) 15 | int -}}
{{- end -}}

{{/* Secrets (names). */}}
{{- define "kvstore.redisSecret" -}}
{{- default (printf "%s-redis-auth" (include "kvstore.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}
{{- define "kvstore.raySecret" -}}
{{- default (printf "%s-ray-auth" (include "kvstore.fullname" .)) .Values.rayCluster.auth.existingSecret -}}
{{- end -}}
{{- define "kvstore.tokenSecret" -}}
{{- default (printf "%s-tokens" (include "kvstore.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}
{{- define "kvstore.tlsSecret" -}}
{{- if .Values.tls.certManager.enabled -}}
{{- printf "%s-node-tls" (include "kvstore.fullname" .) -}}
{{- else -}}
{{- .Values.tls.secretName -}}
{{- end -}}
{{- end -}}
{{/* "true" when the chart's Redis serves TLS: with tls.enabled unless redis.tls.enabled is false. */}}
{{- define "kvstore.redisTls" -}}
{{- if and .Values.redis.enabled .Values.tls.enabled .Values.redis.tls.enabled -}}true{{- end -}}
{{- end -}}
{{- define "kvstore.redisTlsSecret" -}}
{{- if .Values.tls.certManager.enabled -}}
{{- printf "%s-redis-tls" (include "kvstore.fullname" .) -}}
{{- else -}}
{{- .Values.redis.tls.secretName -}}
{{- end -}}
{{- end -}}

{{/* The client certificate of mutual TLS: cert-manager's own, or tls.clientSecretName (default: the node's). */}}
{{- define "kvstore.tlsClientSecret" -}}
{{- if .Values.tls.certManager.enabled -}}
{{- printf "%s-client-tls" (include "kvstore.fullname" .) -}}
{{- else -}}
{{- default .Values.tls.secretName .Values.tls.clientSecretName -}}
{{- end -}}
{{- end -}}
{{- define "kvstore.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "kvstore.nodeService" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}

{{/*
A random secret value that survives upgrades: reuse the one in the cluster when the Secret exists
(lookup returns nothing under `helm template`, which then renders a fresh value).
*/}}
{{- define "kvstore.keepSecret" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .name -}}
{{- if and $existing (hasKey $existing.data .key) -}}
{{- index $existing.data .key -}}
{{- else -}}
{{- randAlphaNum 40 | b64enc -}}
{{- end -}}
{{- end -}}

{{/*
Redis ACL users of the index and their rules: the same strings as kvstore/index/acl.py's
node_rules("*") and CLIENT_RULES (tests/deploy compares them).
*/}}
{{- define "kvstore.redisNodeUser" -}}kvnode{{- end -}}
{{- define "kvstore.redisClientUser" -}}kvclient{{- end -}}
{{- define "kvstore.redisNodeRules" -}}
resetkeys resetchannels nocommands +ping +hello +auth +select +client|setname +client|id +echo +reset %R~kvs:v1:* ~kvs:v1:alive:* ~kvs:v1:epoch:* ~kvs:v1:node:* +get +set +incr +incrby +del +expire +hset +hgetall +hdel +smembers +scan +evalsha +script|load (~kvs:v1:b:* +hset +hdel +hgetall) (~kvs:v1:t:* +hset +hdel +hgetall) (~kvs:v1:nodes +sadd)
{{- end -}}
{{- /* A tenant's read-only index user: kvstore/index/acl.py tenant_client_rules(name). */ -}}
{{- define "kvstore.redisTenantRules" -}}
resetkeys resetchannels nocommands +ping +hello +auth +select +client|setname +client|id +echo +reset ~kvs:v1:alive:* ~kvs:v1:node:* ~kvs:v1:nodes ~kvs:v1:epoch:* ~kvs:v1:t:{{ . }}:* +get +hgetall +smembers +evalsha
{{- end -}}
{{- define "kvstore.redisClientRules" -}}
resetkeys resetchannels nocommands +ping +hello +auth +select +client|setname +client|id +echo +reset ~kvs:v1:alive:* ~kvs:v1:node:* ~kvs:v1:nodes ~kvs:v1:epoch:* ~kvs:v1:b:* +get +hgetall +smembers +evalsha
{{- end -}}

{{/*
KVSTORE_REDIS_URL, built in the pod from a Secret: the password (or the whole external URL) never
appears in a rendered manifest or on a command line. `kvstore.redisEnv` is for clients (workers, the
router, kvctl: the read-only user); `kvstore.redisNodeEnv` for cache nodes (the user that may publish).
*/}}
{{- define "kvstore.redisEnv" -}}
{{- include "kvstore.redisUrlEnv" (dict "ctx" . "user" (include "kvstore.redisClientUser" .) "key" .Values.redis.auth.clientPasswordKey) -}}
{{- end -}}

{{- define "kvstore.redisNodeEnv" -}}
{{- include "kvstore.redisUrlEnv" (dict "ctx" . "user" (include "kvstore.redisNodeUser" .) "key" .Values.redis.auth.nodePasswordKey) -}}
{{- end -}}

{{- define "kvstore.redisUrlEnv" -}}
{{- $v := .ctx.Values -}}
{{- if $v.redis.enabled }}
{{- /* With TLS, the CA every client mounts with the cache plane's (kvstore.clientVolumes, node.yaml). */ -}}
{{- $scheme := ternary "rediss" "redis" (eq (include "kvstore.redisTls" .ctx) "true") }}
{{- $query := ternary "?ssl_ca_certs=/etc/kvstore/tls/ca.crt" "" (eq (include "kvstore.redisTls" .ctx) "true") }}
{{- if $v.redis.auth.enabled }}
- name: REDIS_USER_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvstore.redisSecret" .ctx }}
      key: {{ .key }}
- name: KVSTORE_REDIS_URL
  value: "{{ $scheme }}://{{ .user }}:$(REDIS_USER_PASSWORD)@{{ include "kvstore.redisService" .ctx }}:{{ $v.redis.port }}/0{{ $query }}"
{{- else }}
- name: KVSTORE_REDIS_URL
  value: "{{ $scheme }}://{{ include "kvstore.redisService" .ctx }}:{{ $v.redis.port }}/0{{ $query }}"
{{- end }}
{{- else if $v.redis.external.existingSecret }}
- name: KVSTORE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $v.redis.external.existingSecret }}
      key: {{ $v.redis.external.urlKey }}
{{- else }}
- name: KVSTORE_REDIS_URL
  value: {{ $v.redis.external.url | quote }}
{{- end }}
{{- end -}}

{{/*
Client-side security for pods that call cache nodes: (dict "ctx" $ "role" "rw"|"ro" ["tokenDir" DIR]).
Mounts: see kvstore.clientVolumeMounts / kvstore.clientVolumes.
*/}}
{{- define "kvstore.clientEnv" -}}
{{- $v := .ctx.Values -}}
{{- if $v.tls.enabled }}
- name: KVSTORE_TLS_CA
  value: /etc/kvstore/tls/ca.crt
- name: KVSTORE_TLS_SERVER_NAME
  value: {{ include "kvstore.tlsServerName" .ctx }}
{{- if $v.tls.mutual }}
- name: KVSTORE_TLS_CERT
  value: /etc/kvstore/tls/tls.crt
- name: KVSTORE_TLS_KEY
  value: /etc/kvstore/tls/tls.key
{{- end }}
{{- end }}
{{- if $v.auth.enabled }}
- name: KVSTORE_TOKEN_FILE
  value: {{ .tokenDir | default "/etc/kvstore/token" }}/{{ .role }}.tokens
{{- if and (not $v.tls.enabled) $v.auth.allowPlaintextTokens }}
# auth.allowPlaintextTokens: the operator declared this network trusted (validate.yaml requires it).
- name: KVSTORE_ALLOW_PLAINTEXT_TOKEN
  value: "1"
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvstore.clientVolumeMounts" -}}
{{- $v := .ctx.Values -}}
{{- if $v.tls.enabled }}
- name: kvstore-tls
  mountPath: /etc/kvstore/tls
  readOnly: true
{{- end }}
{{- if $v.auth.enabled }}
- name: kvstore-token
  mountPath: /etc/kvstore/token
  readOnly: true
{{- end }}
{{- end -}}

{{/* A client gets only the token file of its role. */}}
{{- define "kvstore.clientVolumes" -}}
{{- $v := .ctx.Values -}}
{{- if $v.tls.enabled }}
- name: kvstore-tls
  projected:
    defaultMode: 0440
    sources:
      - secret:
          name: {{ include "kvstore.tlsSecret" .ctx }}
          items:
            - {key: ca.crt, path: ca.crt}
{{- if $v.tls.mutual }}
      - secret:
          name: {{ include "kvstore.tlsClientSecret" .ctx }}
          items:
            - {key: tls.crt, path: tls.crt}
            - {key: tls.key, path: tls.key}
{{- end }}
{{- end }}
{{- if $v.auth.enabled }}
- name: kvstore-token
  secret:
    secretName: {{ include "kvstore.tokenSecret" .ctx }}
    defaultMode: 0440  # owner and the pod's fsGroup (= runAsGroup): token files others can read are refused
    items:
      - {key: {{ .role }}.tokens, path: {{ .role }}.tokens}
{{- end }}
{{- end -}}

{{/* Ray token auth for every Ray container (head, workers, router). */}}
{{- define "kvstore.rayAuthEnv" -}}
{{- if .Values.rayCluster.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvstore.raySecret" . }}
      key: {{ .Values.rayCluster.auth.tokenKey }}
{{- end }}
{{- end -}}

{{- define "kvstore.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvstore.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Who may call the cache plane and Redis: the Ray pods (workers, router), the chart's own
client pods, and pods labelled networkPolicy.clientLabel in this namespace. */}}
{{- define "kvstore.cachePeers" -}}
{{- if .Values.rayCluster.enabled }}
- podSelector:
    matchLabels:
      ray.io/cluster: {{ include "kvstore.rayClusterName" . }}
{{- end }}
- podSelector:
    matchLabels:
      {{- toYaml .Values.networkPolicy.clientLabel | nindent 6 }}
{{- end }}

{{/* A size value as a flag: a quantity string as given, a number as whole bytes (never 1e+09). */}}
{{- define "kvstore.qty" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ printf "%.0f" (float64 .) }}{{- end -}}
{{- end -}}
