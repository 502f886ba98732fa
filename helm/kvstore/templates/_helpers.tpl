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
{{- $handoff := ternary (ceil .Values.node.shutdown.handoffSeconds) 0 .Values.node.replication.enabled -}}
{{- add (ceil .Values.node.shutdown.drainSeconds) (ceil .Values.node.shutdown.spillSeconds) $handoff 15 | int -}}
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
{{- /* Redis Sentinel (redis.sentinel.enabled, the chart's own Redis): pods' DNS names live under the
headless Service; clients reach the sentinels through the Redis Service's sentinel port. */ -}}
{{- define "kvstore.redisSentinel" -}}
{{- if and .Values.redis.enabled .Values.redis.sentinel.enabled -}}true{{- end -}}
{{- end -}}
{{- /* Redis Cluster (redis.cluster.enabled, the chart's own Redis): pods' DNS names under the headless
Service too (each announces its own); clients ask the Redis Service for the slot map. */ -}}
{{- define "kvstore.redisCluster" -}}
{{- if and .Values.redis.enabled .Values.redis.cluster.enabled -}}true{{- end -}}
{{- end -}}
{{- /* How many Redis pods the StatefulSet runs. */ -}}
{{- define "kvstore.redisPods" -}}
{{- if include "kvstore.redisCluster" . -}}
{{- mul .Values.redis.cluster.masters (add 1 .Values.redis.cluster.replicasPerMaster) -}}
{{- else if include "kvstore.redisSentinel" . -}}
{{- .Values.redis.sentinel.replicas -}}
{{- else -}}
1
{{- end -}}
{{- end -}}
{{- define "kvstore.redisHeadless" -}}{{ include "kvstore.redisService" . }}-headless{{- end -}}
{{- define "kvstore.redisPodDomain" -}}{{ include "kvstore.redisHeadless" . }}.{{ .Release.Namespace }}.svc{{- end -}}
{{- /* The sentinels' read-only user: kvstore/index/acl.py SENTINEL_CLIENT_USER / SENTINEL_CLIENT_RULES. */ -}}
{{- define "kvstore.sentinelClientUser" -}}kvsentinel{{- end -}}
{{- define "kvstore.sentinelClientRules" -}}
resetchannels -@all +ping +hello +auth +client|setname +client|id +sentinel|masters +sentinel|master +sentinel|get-master-addr-by-name +sentinel|slaves +sentinel|replicas +sentinel|sentinels
{{- end -}}

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
resetkeys resetchannels nocommands +ping +hello +auth +select +client|setname +client|id +echo +reset +cluster|slots +command +asking %R~kvs:v2:* ~kvs:v2:{n}:alive:* ~kvs:v2:{n}:beat:* ~kvs:v2:{n}:epoch:* ~kvs:v2:{n}:node:* +get +mget +set +incr +incrby +del +expire +exists +hset +hgetall +hmget +hscan +smembers +scan +info +script|load (~kvs:v2:b:* +evalsha +hget +hset +hdel) (~kvs:v2:t:* +evalsha +hget +hset +hdel) (~kvs:v2:{n}:nodes +sadd)
{{- end -}}
{{- /* A tenant's read-only index user: kvstore/index/acl.py tenant_client_rules(name). */ -}}
{{- define "kvstore.redisTenantRules" -}}
resetkeys resetchannels nocommands +ping +hello +auth +select +client|setname +client|id +echo +reset +cluster|slots +command +asking %R~kvs:v2:{n}:* %R~kvs:v2:t:{{ . }}:* +get +mget +hgetall +hmget +smembers
{{- end -}}
{{- define "kvstore.redisClientRules" -}}
resetkeys resetchannels nocommands +ping +hello +auth +select +client|setname +client|id +echo +reset +cluster|slots +command +asking %R~kvs:v2:{n}:* %R~kvs:v2:b:* +get +mget +hgetall +hmget +smembers
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
{{- if and $v.redis.enabled (include "kvstore.redisSentinel" .ctx) }}
{{- /* Through the sentinels (kvstore/index/connect.py): the data user's password, and the sentinels'
read-only user's, both from the Secret; validate.yaml requires redis.auth.enabled here. */ -}}
{{- $tls := eq (include "kvstore.redisTls" .ctx) "true" }}
- name: REDIS_USER_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvstore.redisSecret" .ctx }}
      key: {{ .key }}
- name: REDIS_SENTINEL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvstore.redisSecret" .ctx }}
      key: {{ $v.redis.auth.sentinelClientPasswordKey }}
- name: KVSTORE_REDIS_URL
  value: "{{ ternary "rediss" "redis" $tls }}+sentinel://{{ .user }}:$(REDIS_USER_PASSWORD)@{{ include "kvstore.redisService" .ctx }}:{{ $v.redis.sentinel.port }}/{{ $v.redis.sentinel.masterName }}/0?sentinel_username={{ include "kvstore.sentinelClientUser" .ctx }}&sentinel_password=$(REDIS_SENTINEL_PASSWORD){{ ternary "&ssl_ca_certs=/etc/kvstore/tls/ca.crt" "" $tls }}"
{{- else if and $v.redis.enabled (include "kvstore.redisCluster" .ctx) }}
{{- /* A Redis Cluster (kvstore/index/connect.py): the Service answers for the slot map, the pods by
their own names after that; validate.yaml requires redis.auth.enabled here. */ -}}
{{- $tls := eq (include "kvstore.redisTls" .ctx) "true" }}
- name: REDIS_USER_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvstore.redisSecret" .ctx }}
      key: {{ .key }}
- name: KVSTORE_REDIS_URL
  value: "{{ ternary "rediss" "redis" $tls }}+cluster://{{ .user }}:$(REDIS_USER_PASSWORD)@{{ include "kvstore.redisService" .ctx }}:{{ $v.redis.port }}/{{ ternary "?ssl_ca_certs=/etc/kvstore/tls/ca.crt" "" $tls }}"
{{- else if $v.redis.enabled }}
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
Client-side security for pods that call cache nodes: (dict "ctx" $ "role" "rw"|"ro" ["tokenDir" DIR]
["tokenFile" FILE]). Mounts: see kvstore.clientVolumeMounts / kvstore.clientVolumes.
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
  value: {{ .tokenFile | default (printf "%s/%s.tokens" (.tokenDir | default "/etc/kvstore/token") .role) }}
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

{{/* A client gets only the token file of its role (or "tokenKey" of the Secret, as "tokenPath"). */}}
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
      - {key: {{ .tokenKey | default (printf "%s.tokens" .role) }}, path: {{ .tokenPath | default (printf "%s.tokens" .role) }}}
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
{{- if .Values.engines.enabled }}
- podSelector:
    matchLabels:
      {{- include "kvstore.componentSelector" (dict "ctx" . "component" "engine") | nindent 6 }}
{{- end }}
- podSelector:
    matchLabels:
      {{- toYaml .Values.networkPolicy.clientLabel | nindent 6 }}
{{- end }}

{{/* A size value as a flag: a quantity string as given, a number as whole bytes (never 1e+09). */}}
{{- define "kvstore.qty" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ printf "%.0f" (float64 .) }}{{- end -}}
{{- end -}}

{{/*
The same-host plane (node.localSocket): one host directory per release, mounted at hostDir in the node
pod (read-write: the node creates the socket) and in every client pod (read-only: connecting to a socket
needs write access to the socket file, not to the mount).
*/}}
{{- define "kvstore.localSocketOn" -}}
{{- if and .Values.node.enabled .Values.node.localSocket.enabled -}}true{{- end -}}
{{- end -}}
{{- define "kvstore.localSocketDir" -}}{{ trimSuffix "/" .Values.node.localSocket.hostDir }}{{- end -}}
{{- define "kvstore.localSocketPath" -}}{{ include "kvstore.localSocketDir" . }}/node.sock{{- end -}}

{{/* A client's view of its host: the node there (KVSTORE_LOCAL_NODE) and that node's socket. */}}
{{- define "kvstore.localNodeEnv" -}}
# The cache node on this host is named after the host (see the node workload).
- name: KVSTORE_LOCAL_NODE
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- if include "kvstore.localSocketOn" . }}
- name: KVSTORE_LOCAL_SOCKET
  value: {{ include "kvstore.localSocketPath" . }}
{{- end }}
{{- end -}}

{{/* (dict "ctx" $ "readOnly" bool) */}}
{{- define "kvstore.localSocketMount" -}}
{{- if include "kvstore.localSocketOn" .ctx }}
- name: kvstore-local-socket
  mountPath: {{ include "kvstore.localSocketDir" .ctx }}
  {{- if .readOnly }}
  readOnly: true
  {{- end }}
{{- end }}
{{- end -}}

{{- define "kvstore.localSocketVolume" -}}
{{- if include "kvstore.localSocketOn" . }}
- name: kvstore-local-socket
  hostPath:
    path: {{ printf "%s/%s" (include "kvstore.localSocketDir" .) (include "kvstore.fullname" .) }}
    type: DirectoryOrCreate
{{- end }}
{{- end -}}

{{/* Client pods join the socket directory's group, whatever user their image runs as. */}}
{{- define "kvstore.clientPodSecurity" -}}
{{ include "kvstore.podSecurity" . }}
{{- if include "kvstore.localSocketOn" . }}
supplementalGroups: [{{ .Values.node.localSocket.group }}]
{{- end }}
{{- end -}}

{{/*
UCX and RDMA (node.dataPlanes.ucx). "client" pods (workers, engines) get the UCX environment always, and
the RDMA devices, capabilities and networks where rdma.clients is true.
*/}}
{{- define "kvstore.ucxOn" -}}
{{- if and .Values.node.enabled .Values.node.dataPlanes.ucx.enabled -}}true{{- end -}}
{{- end -}}
{{- define "kvstore.rdmaOn" -}}
{{- $u := .Values.node.dataPlanes.ucx -}}
{{- if and (include "kvstore.ucxOn" .) (dig "rdma" "enabled" false $u) -}}true{{- end -}}
{{- end -}}
{{/* (dict "ctx" $ "client" bool): "true" when this pod gets the RDMA devices, capabilities and network. */}}
{{- define "kvstore.rdmaHere" -}}
{{- $u := .ctx.Values.node.dataPlanes.ucx -}}
{{- if and (include "kvstore.rdmaOn" .ctx) (or (not .client) (dig "rdma" "clients" true $u)) -}}true{{- end -}}
{{- end -}}

{{/* (dict "ctx" $ "client" bool) */}}
{{- define "kvstore.ucxEnv" -}}
{{- $u := .ctx.Values.node.dataPlanes.ucx -}}
{{- if include "kvstore.ucxOn" .ctx }}
{{- range $k, $val := ($u.env | default dict) }}
- name: {{ $k }}
  value: {{ toString $val | quote }}
{{- end }}
{{- if and (not .client) $u.tcpPortRange }}
# UCX's TCP lanes listen here, inside what the NetworkPolicy opens.
- name: UCX_TCP_PORT_RANGE
  value: {{ $u.tcpPortRange | quote }}
{{- end }}
{{- if and .client .ctx.Values.tls.enabled $u.allowPlaintext }}
# node.dataPlanes.ucx.allowPlaintext: the operator declared the fabric trusted (UCX is not encrypted).
- name: KVSTORE_UCX_ALLOW_PLAINTEXT
  value: "1"
{{- end }}
{{- if include "kvstore.rdmaHere" . }}
# ucxx loads the image's system UCX (built with verbs): the PyPI UCX wheel has no InfiniBand/RoCE.
- name: RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY
  value: "true"
{{- end }}
{{- end }}
{{- end -}}

{{/* RDMA device-plugin resources as "name: count" lines: (dict "ctx" $ "client" bool) */}}
{{- define "kvstore.rdmaResources" -}}
{{- if include "kvstore.rdmaHere" . }}
{{- $r := .ctx.Values.node.dataPlanes.ucx.rdma -}}
{{- $res := $r.resources | default dict -}}
{{- if and .client $r.clientResources }}{{ $res = $r.clientResources }}{{ end -}}
{{- range $k, $val := $res }}
{{ $k }}: {{ $val | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* securityContext of a container that moves pages (node, worker, LMCache): (dict "ctx" $ "client" bool) */}}
{{- define "kvstore.dataContainerSecurity" -}}
{{- $r := .ctx.Values.node.dataPlanes.ucx.rdma | default dict -}}
{{- if and (include "kvstore.rdmaHere" .) $r.hostDevices }}
# rdma.hostDevices: the host's /dev/infiniband is usable only by a privileged container.
privileged: true
{{- else }}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
  {{- if and (include "kvstore.rdmaHere" .) $r.ipcLock }}
  add: [IPC_LOCK]  # pin (register) RDMA memory beyond RLIMIT_MEMLOCK
  {{- end }}
{{- end }}
{{- end -}}

{{- define "kvstore.rdmaVolumeMounts" -}}
{{- if and (include "kvstore.rdmaHere" .) .ctx.Values.node.dataPlanes.ucx.rdma.hostDevices }}
- name: dev-infiniband
  mountPath: /dev/infiniband
{{- end }}
{{- end -}}
{{- define "kvstore.rdmaVolumes" -}}
{{- if and (include "kvstore.rdmaHere" .) .ctx.Values.node.dataPlanes.ucx.rdma.hostDevices }}
- name: dev-infiniband
  hostPath:
    path: /dev/infiniband
    type: Directory
{{- end }}
{{- end -}}

{{/* Pod annotations attaching the RDMA secondary network (Multus): (dict "ctx" $ "client" bool) */}}
{{- define "kvstore.networkAnnotations" -}}
{{- $n := .ctx.Values.node.dataPlanes.ucx.network | default dict -}}
{{- if and (include "kvstore.ucxOn" .ctx) $n.attachments (or (not .client) (include "kvstore.rdmaHere" .) (not (include "kvstore.rdmaOn" .ctx))) }}
k8s.v1.cni.cncf.io/networks: {{ $n.attachments | quote }}
{{- end }}
{{- end -}}

{{/*
An init container that fails the pod, naming the fix, when RDMA memory could not be pinned: neither is
CAP_IPC_LOCK effective (bit 14 of CapEff) nor is RLIMIT_MEMLOCK unlimited. It runs as the main
container's user with its securityContext, so it sees what the main container will.
(dict "ctx" $ "client" bool "image" IMAGE)
*/}}
{{- define "kvstore.memlockCheck" -}}
{{- $r := .ctx.Values.node.dataPlanes.ucx.rdma | default dict -}}
{{- if and (include "kvstore.rdmaHere" .) $r.memlockCheck }}
- name: memlock-check
  image: {{ .image }}
  imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
  command:
    - sh
    - -c
    - |
      lim=$(ulimit -l); cap=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)
      if [ "$lim" = unlimited ] || [ $(( 0x$cap >> 14 & 1 )) -eq 1 ]; then
        echo "RDMA memory pinning: RLIMIT_MEMLOCK=$lim, CapEff=$cap: ok"; exit 0
      fi
      echo "RDMA needs pinned memory, but RLIMIT_MEMLOCK is $lim KiB and CAP_IPC_LOCK is not effective for uid $(id -u)." >&2
      echo "Fix: raise the container runtime's memlock limit (containerd: LimitMEMLOCK=infinity in its systemd unit; CRI-O: default_ulimits = [\"memlock=-1:-1\"]), or set node.dataPlanes.ucx.rdma.memlockCheck: false to start anyway." >&2
      exit 1
  securityContext:
    {{- include "kvstore.dataContainerSecurity" (dict "ctx" .ctx "client" .client) | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 32Mi}
{{- end }}
{{- end -}}

{{- define "kvstore.engineImage" -}}
{{- printf "%s:%s" .Values.engines.image.repository (default .Chart.AppVersion .Values.engines.image.tag) -}}
{{- end -}}
{{- define "kvstore.nodeLocalService" -}}{{ include "kvstore.fullname" . }}-node-local{{- end -}}

{{/*
The Redis index URL without credentials, for a command line (engines.lmcache.target: cluster). validate.yaml
refuses that target where the URL would need a password (the chart's Redis with auth, an external Secret).
*/}}
{{- define "kvstore.redisPlainUrl" -}}
{{- $v := .Values -}}
{{- if $v.redis.enabled -}}
{{- $tls := eq (include "kvstore.redisTls" .) "true" -}}
{{- if include "kvstore.redisSentinel" . -}}
{{- printf "%s+sentinel://%s:%d/%s/0%s" (ternary "rediss" "redis" $tls) (include "kvstore.redisService" .) (int $v.redis.sentinel.port) $v.redis.sentinel.masterName (ternary "?ssl_ca_certs=/etc/kvstore/tls/ca.crt" "" $tls) -}}
{{- else if include "kvstore.redisCluster" . -}}
{{- printf "%s+cluster://%s:%d/%s" (ternary "rediss" "redis" $tls) (include "kvstore.redisService" .) (int $v.redis.port) (ternary "?ssl_ca_certs=/etc/kvstore/tls/ca.crt" "" $tls) -}}
{{- else -}}
{{- printf "%s://%s:%d/0%s" (ternary "rediss" "redis" $tls) (include "kvstore.redisService" .) (int $v.redis.port) (ternary "?ssl_ca_certs=/etc/kvstore/tls/ca.crt" "" $tls) -}}
{{- end -}}
{{- else -}}
{{- $v.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/*
The engine pair's wiring, one place for the chart and for `kvstore up --values` (kvstore/cli/engines.py
builds the same JSON; tests/deploy compares them): kvstore's L2 adapter spec for `lmcache server
--l2-adapter`, and vLLM's kv_transfer_config pointing LMCacheMPConnector at that server.
*/}}
{{- define "kvstore.l2AdapterSpec" -}}
{{- $l := .Values.engines.lmcache -}}
{{- $params := dict -}}
{{- if eq $l.target "local" -}}
{{- $_ := set $params "target" (printf "%s:%d" (include "kvstore.nodeLocalService" .) (int .Values.node.port)) -}}
{{- else -}}
{{- $_ := set $params "redis_url" (include "kvstore.redisPlainUrl" .) -}}
{{- end -}}
{{- with $l.namespace }}{{ $_ := set $params "namespace" . }}{{ end -}}
{{- with $l.transport }}{{ $_ := set $params "transport" . }}{{ end -}}
{{- if gt (float64 $l.timeoutS) 0.0 }}{{ $_ := set $params "timeout_s" (float64 $l.timeoutS) }}{{ end -}}
{{- if .Values.auth.enabled }}{{ $_ := set $params "token_file" "/etc/kvstore/token/engine.token" }}{{ end -}}
{{- toJson (dict "type" "plugin" "module_path" "kvstore.integrations.lmcache_l2" "class_name" "KVStoreL2Adapter" "adapter_params" $params) -}}
{{- end -}}
{{- define "kvstore.kvTransferConfig" -}}
{{- $extra := dict "lmcache.mp.host" "tcp://127.0.0.1" "lmcache.mp.port" (int .Values.engines.lmcache.port) -}}
{{- toJson (dict "kv_connector" "LMCacheMPConnector" "kv_role" "kv_both" "kv_connector_extra_config" $extra) -}}
{{- end -}}
