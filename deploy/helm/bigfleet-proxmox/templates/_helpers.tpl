{{/*
Named templates shared by the manifests. The chart keeps to a small template
subset (values, if/else, range, include, default, quote, required, fail,
toYaml | nindent, join, trunc, trimSuffix, sha256sum, dict, dig, keys,
sortAlpha, contains, index, lookup and .Files.Get) so crates/deploy-check can render and validate it without a helm
binary.
*/}}

{{- define "bigfleet-proxmox.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bigfleet-proxmox.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (default .Chart.Name .Values.nameOverride) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "bigfleet-proxmox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bigfleet-proxmox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bigfleet-proxmox.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "bigfleet-proxmox.selectorLabels" . }}
app.kubernetes.io/version: {{ default .Chart.AppVersion .Values.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: capacity-provider
{{- end -}}

{{- define "bigfleet-proxmox.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bigfleet-proxmox.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "bigfleet-proxmox.stateClaimName" -}}
{{- if .Values.state.persistence.existingClaim -}}
{{- .Values.state.persistence.existingClaim -}}
{{- else -}}
{{- printf "%s-state" (include "bigfleet-proxmox.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
Where the state is: "true" (a non-empty string) or "" (false), for `if`.
postgres: state.enabled with state.postgres.url set; sqlite: state.enabled
without it (the file on the PVC).
*/}}
{{- define "bigfleet-proxmox.postgres" -}}
{{- if and .Values.state.enabled .Values.state.postgres.url -}}true{{- end -}}
{{- end -}}

{{- define "bigfleet-proxmox.sqlite" -}}
{{- if and .Values.state.enabled (not .Values.state.postgres.url) -}}true{{- end -}}
{{- end -}}

{{- define "bigfleet-proxmox.postgresCA" -}}
{{- if or .Values.state.postgres.ca.secretName .Values.state.postgres.ca.configMapName -}}true{{- end -}}
{{- end -}}

{{/*
--state's URL: state.postgres.url, with sslrootcert= naming the mounted CA
file when a CA is set.
*/}}
{{- define "bigfleet-proxmox.postgresURL" -}}
{{- $url := .Values.state.postgres.url -}}
{{- if include "bigfleet-proxmox.postgresCA" . -}}
{{- $file := printf "/etc/bigfleet/postgres-ca/%s" .Values.state.postgres.ca.key -}}
{{- if contains "?" $url -}}
{{- printf "%s&sslrootcert=%s" $url $file -}}
{{- else -}}
{{- printf "%s?sslrootcert=%s" $url $file -}}
{{- end -}}
{{- else -}}
{{- $url -}}
{{- end -}}
{{- end -}}

{{/*
The config ConfigMap's data; the pod template carries its checksum.
*/}}
{{- define "bigfleet-proxmox.configData" -}}
{{- if .Values.offerings.content }}
offerings.json: |
  {{- .Values.offerings.content | nindent 2 }}
{{- end }}
{{- if .Values.instanceTypes.content }}
instance-types.json: |
  {{- .Values.instanceTypes.content | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
proxmox.nodeStorage as --node-storage's NODE=STORAGE,... value, in node-name
order (a map's own order is random, which would change the pod template on
every upgrade).
*/}}
{{- define "bigfleet-proxmox.nodeStorage" -}}
{{- $storage := .Values.proxmox.nodeStorage -}}
{{- range $i, $node := keys $storage | sortAlpha -}}
{{- if $i }},{{ end }}{{ $node }}={{ index $storage $node }}
{{- end -}}
{{- end -}}

{{/*
proxmox.storageOvercommit as --storage-overcommit's STORAGE=FACTOR,... value,
in storage-id order (a stable pod template across upgrades).
*/}}
{{- define "bigfleet-proxmox.storageOvercommit" -}}
{{- $factors := .Values.proxmox.storageOvercommit -}}
{{- range $i, $storage := keys $factors | sortAlpha -}}
{{- if $i }},{{ end }}{{ $storage }}={{ index $factors $storage }}
{{- end -}}
{{- end -}}

{{/*
Checksum of a Secret the chart mounts but does not create: its name, the key
and, when helm can read the Secret (install and upgrade; not `helm template`),
the key's data. Called with (dict "namespace" .. "name" .. "key" ..).
*/}}
{{- define "bigfleet-proxmox.secretChecksum" -}}
{{- $secret := lookup "v1" "Secret" .namespace .name -}}
{{- printf "%s/%s:%s" .name .key (dig "data" .key "" $secret) | sha256sum -}}
{{- end -}}

{{/*
Render-time validation. The provider refuses these configurations at startup
too; failing here keeps a broken release from ever being applied.
*/}}
{{- define "bigfleet-proxmox.validate" -}}
{{- if .Values.fakeBackend.enabled -}}
{{- if .Values.proxmox.apiURL -}}
{{- fail "fakeBackend.enabled and proxmox.apiURL are mutually exclusive: the fake backend is for testing and certification only" -}}
{{- end -}}
{{- else -}}
{{- if not .Values.proxmox.apiURL -}}
{{- fail "proxmox.apiURL is required (--proxmox-api-url), e.g. https://pve1:8006/api2/json; set fakeBackend.enabled only for testing" -}}
{{- end -}}
{{- if not .Values.proxmox.tokenID -}}
{{- fail "proxmox.tokenID is required (--proxmox-token-id), e.g. bigfleet@pve!autoscaler" -}}
{{- end -}}
{{- if not .Values.proxmox.nodes -}}
{{- fail "proxmox.nodes is required (--nodes): the Proxmox node names that act as zones" -}}
{{- end -}}
{{- if not .Values.credentials.token.secretName -}}
{{- fail "credentials.token.secretName is required: a Secret holding the API token secret (--proxmox-token-file)" -}}
{{- end -}}
{{- if and (not .Values.credentials.ca.secretName) (not .Values.proxmox.tlsFingerprint) -}}
{{- fail "TLS verification material is required: set credentials.ca.secretName (--proxmox-ca-file) or proxmox.tlsFingerprint (--proxmox-tls-fingerprint); verification of the Proxmox API cannot be disabled" -}}
{{- end -}}
{{- end -}}
{{- if and (eq (default "full" .Values.proxmox.cloneMode) "linked") .Values.proxmox.nodeStorage -}}
{{- fail "proxmox.cloneMode linked keeps every clone's disks on its template's storage (PVE refuses a target storage for linked clones): empty proxmox.nodeStorage, or set proxmox.cloneMode full" -}}
{{- end -}}
{{- if .Values.state.postgres.url -}}
{{- if not .Values.state.enabled -}}
{{- fail "state.postgres.url needs state.enabled: true (state.enabled false keeps the state in memory)" -}}
{{- end -}}
{{- if and .Values.state.postgres.ca.secretName .Values.state.postgres.ca.configMapName -}}
{{- fail "state.postgres.ca: set secretName or configMapName, not both" -}}
{{- end -}}
{{- if and (include "bigfleet-proxmox.postgresCA" .) (contains "sslrootcert=" .Values.state.postgres.url) -}}
{{- fail "state.postgres.url carries sslrootcert= and state.postgres.ca is set: drop sslrootcert= from the URL (the chart names the mounted CA file)" -}}
{{- end -}}
{{- end -}}
{{- if gt (int .Values.replicaCount) 1 -}}
{{- if not (include "bigfleet-proxmox.postgres" .) -}}
{{- fail "replicaCount above 1 needs the state in PostgreSQL: set state.postgres.url (see docs/install.md, High availability on PostgreSQL), or set replicaCount to 1 (an SQLite state is one file that one process owns)" -}}
{{- end -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- if not .Values.tls.secretName -}}
{{- fail "tls.secretName is required when tls.enabled is true: a kubernetes.io/tls Secret with tls.crt and tls.key (plus ca.crt for tls.mtls)" -}}
{{- end -}}
{{- else -}}
{{- if .Values.tls.mtls -}}
{{- fail "tls.mtls requires tls.enabled (the provider rejects --tls-ca without --tls-cert/--tls-key)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
