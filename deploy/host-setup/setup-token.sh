#!/usr/bin/env bash
# Creates the least-privilege Proxmox VE identity the BigFleet provider runs as:
# a resource pool, a role holding exactly the privileges the provider uses, a
# user, the ACLs that scope it, and an API token. Run it as root on one node of
# the cluster (the configuration is cluster-wide). Safe to re-run: objects that
# already exist are kept, and the role's privilege list is reset to the one below.
#
# Usage: setup-token.sh [options]     (every option also reads an env variable)
#   --user USER@REALM     BIGFLEET_PVE_USER       default bigfleet@pve
#   --token NAME          BIGFLEET_PVE_TOKEN      default autoscaler
#   --role NAME           BIGFLEET_PVE_ROLE       default BigFleetProvisioner
#   --pool NAME           BIGFLEET_PVE_POOL       default bigfleet
#   --template-vmid LIST  BIGFLEET_TEMPLATE_VMIDS default 9000 (comma list)
#   --storage LIST        BIGFLEET_PVE_STORAGES   default local-lvm (comma list:
#                         storages the full clones' disks are allocated on)
#   --bridge LIST         BIGFLEET_PVE_BRIDGES    default vmbr0 (comma list of
#                         bridges or SDN VNets the template's NICs use;
#                         empty = skip)
#   --sdn-zone NAME       BIGFLEET_PVE_SDN_ZONE   default: per bridge, the SDN
#                         VNet's own zone, else localnetwork (pvesh)
#   --pci-mapping LIST    BIGFLEET_PVE_PCI_MAPPINGS default none (comma list of
#                         the PCI resource mappings instance types' `pci`
#                         names: VM.Config.HWType joins the role, and
#                         PVEMappingUser is granted on each; PVE 8 or newer)
#   --pve-major N         BIGFLEET_PVE_MAJOR      default: read from pveversion
#   --secret-file PATH    BIGFLEET_SECRET_FILE    also write the secret here (mode 0600)
#   --rotate-token                                delete and re-create an existing token
#   -h, --help
set -euo pipefail

prog=${0##*/}

USER_ID=${BIGFLEET_PVE_USER:-bigfleet@pve}
TOKEN_NAME=${BIGFLEET_PVE_TOKEN:-autoscaler}
ROLE=${BIGFLEET_PVE_ROLE:-BigFleetProvisioner}
POOL=${BIGFLEET_PVE_POOL:-bigfleet}
TEMPLATES=${BIGFLEET_TEMPLATE_VMIDS:-9000}
STORAGES=${BIGFLEET_PVE_STORAGES:-local-lvm}
BRIDGES=${BIGFLEET_PVE_BRIDGES-vmbr0}
SDN_ZONE=${BIGFLEET_PVE_SDN_ZONE:-}
PCI_MAPPINGS=${BIGFLEET_PVE_PCI_MAPPINGS:-}
PVE_MAJOR=${BIGFLEET_PVE_MAJOR:-}
SECRET_FILE=${BIGFLEET_SECRET_FILE:-}
ROTATE=0

die() {
    printf '%s: error: %s\n' "$prog" "$*" >&2
    exit 1
}

usage() {
    sed -n '/^# Usage:/,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

need_value() {
    [[ $# -ge 2 && -n $2 && $2 != --* ]] || die "$1 needs a value"
}

while [[ $# -gt 0 ]]; do
    case $1 in
        --user) need_value "$@"; USER_ID=$2; shift 2 ;;
        --token) need_value "$@"; TOKEN_NAME=$2; shift 2 ;;
        --role) need_value "$@"; ROLE=$2; shift 2 ;;
        --pool) need_value "$@"; POOL=$2; shift 2 ;;
        --template-vmid) need_value "$@"; TEMPLATES=$2; shift 2 ;;
        --storage) need_value "$@"; STORAGES=$2; shift 2 ;;
        --bridge) [[ $# -ge 2 ]] || die "--bridge needs a value"; BRIDGES=$2; shift 2 ;;
        --sdn-zone) need_value "$@"; SDN_ZONE=$2; shift 2 ;;
        --pci-mapping) need_value "$@"; PCI_MAPPINGS=$2; shift 2 ;;
        --pve-major) need_value "$@"; PVE_MAJOR=$2; shift 2 ;;
        --secret-file) need_value "$@"; SECRET_FILE=$2; shift 2 ;;
        --rotate-token) ROTATE=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown option '$1' (see --help)" ;;
    esac
done

[[ $USER_ID =~ ^[^@[:space:]]+@[A-Za-z0-9_.-]+$ ]] || die "--user must look like USER@REALM, got '$USER_ID'"
[[ $TOKEN_NAME =~ ^[A-Za-z][A-Za-z0-9._-]*$ ]] || die "--token must be a plain token name, got '$TOKEN_NAME'"
[[ $POOL =~ ^[A-Za-z0-9_.-]+$ ]] || die "--pool must be a plain pool name, got '$POOL'"
[[ $ROLE =~ ^[A-Za-z0-9_.-]+$ ]] || die "--role must be a plain role name, got '$ROLE'"
IFS=, read -r -a template_ids <<<"$TEMPLATES"
[[ ${#template_ids[@]} -gt 0 ]] || die "--template-vmid needs at least one VMID"
for id in "${template_ids[@]}"; do
    [[ $id =~ ^[1-9][0-9]*$ ]] || die "--template-vmid: '$id' is not a VMID"
done
IFS=, read -r -a storage_ids <<<"$STORAGES"
[[ ${#storage_ids[@]} -gt 0 ]] || die "--storage needs at least one storage id"
bridge_ids=()
if [[ -n $BRIDGES ]]; then
    IFS=, read -r -a bridge_ids <<<"$BRIDGES"
fi
pci_ids=()
if [[ -n $PCI_MAPPINGS ]]; then
    IFS=, read -r -a pci_ids <<<"$PCI_MAPPINGS"
fi
for m in "${pci_ids[@]}"; do
    [[ $m =~ ^[A-Za-z][A-Za-z0-9_-]*$ ]] || die "--pci-mapping: '$m' is not a resource mapping id"
done

command -v pveum >/dev/null 2>&1 || die "pveum not found: run this on a Proxmox VE node"

if [[ -z $PVE_MAJOR ]]; then
    command -v pveversion >/dev/null 2>&1 || die "pveversion not found: pass --pve-major"
    # "pve-manager/8.2.4/faa83925c9641325 (running kernel: ...)"
    PVE_MAJOR=$(pveversion | sed -n 's|^pve-manager/\([0-9][0-9]*\)\..*|\1|p' | head -n 1)
    [[ -n $PVE_MAJOR ]] || die "could not read the Proxmox VE version from pveversion; pass --pve-major"
fi
[[ $PVE_MAJOR =~ ^[0-9]+$ ]] || die "--pve-major must be a number, got '$PVE_MAJOR'"
[[ $PVE_MAJOR -ge 7 ]] || die "Proxmox VE $PVE_MAJOR is not supported (7 or newer)"

# The provider's privileges, each for the API calls that need it:
privs=(
    VM.Allocate      # clone into a new VMID in the pool; destroy (purge) the clone
    VM.Config.CPU    # set the clone's cores from the instance type
    VM.Config.Memory # set the clone's memory from the instance type
    VM.Config.Options # write the name, tags and the description marker
    VM.PowerMgmt     # start after clone and EnsureRunning; stop before destroy
    VM.Audit         # read status/current, config (marker), cluster/resources inventory
    Datastore.AllocateSpace # allocate the full clone's disks (granted on /storage/<id>)
    Pool.Audit       # read the pool's members
    VM.Clone         # clone from a per-node template replica (it lives in the pool)
    VM.Migrate       # move a staged replica offline to its node
    VM.Config.Disk   # a replica migration's targetstorage (--node-storage); growing a boot disk (disk_gib)
)
# Guest-agent calls (agent/ping, agent/file-write, agent/exec, exec-status) carry
# the bootstrap and the drain. Up to 8 they need VM.Monitor; 9 replaced it with
# the VM.GuestAgent.* privileges.
if [[ $PVE_MAJOR -ge 9 ]]; then
    privs+=(
        VM.GuestAgent.Audit        # agent/ping while waiting for the guest
        VM.GuestAgent.FileWrite    # agent/file-write of the bootstrap blob
        VM.GuestAgent.Unrestricted # agent/exec + exec-status (bootstrap, kubectl drain)
    )
else
    privs+=(VM.Monitor) # every agent/* call
fi
# Instance types with mapped PCI devices (GPUs): the clone's hostpciN entries
# (qemu-server check_hostpci_perm). Resource mappings exist from PVE 8.
if [[ ${#pci_ids[@]} -gt 0 ]]; then
    [[ $PVE_MAJOR -ge 8 ]] || die "--pci-mapping needs Proxmox VE 8 or newer (cluster resource mappings)"
    privs+=(VM.Config.HWType) # set a clone's hostpciN: mapping=<name> (an instance type's pci)
fi
# Not granted: VM.Config.Network/Cloudinit, nor HWType without --pci-mapping
# (clones keep the template's hardware), Sys.Console (a template with the host's CD-ROM drive
# is refused at start-up instead), Datastore.Audit (the storage status and lists read for
# room checks and replicas need only Datastore.AllocateSpace), Sys.*,
# Pool.Allocate, Permissions.Modify.
template_privs=(
    VM.Clone # POST /nodes/{node}/qemu/{template}/clone
    VM.Audit # read the template's config and status
)

# Runs pveum; an "already exists" refusal counts as success and returns 3.
# Any other failure stops the script with pveum's message.
pveum_idempotent() {
    local out rc=0
    out=$(pveum "$@" 2>&1) || rc=$?
    if [[ $rc -eq 0 ]]; then
        [[ -z $out ]] || printf '%s\n' "$out"
        return 0
    fi
    if [[ $out == *"already exists"* ]]; then
        return 3
    fi
    printf '%s\n' "$out" >&2
    die "pveum $* failed (exit $rc)"
}

join_by() {
    local IFS=$1
    shift
    printf '%s' "$*"
}

step() { printf '==> %s\n' "$*"; }

step "role $ROLE: ${privs[*]}"
rc=0
pveum_idempotent role add "$ROLE" --privs "$(join_by , "${privs[@]}")" || rc=$?
if [[ $rc -eq 3 ]]; then
    # Reset (not append) so a re-run also removes privileges no longer needed.
    pveum_idempotent role modify "$ROLE" --privs "$(join_by , "${privs[@]}")"
elif [[ $rc -ne 0 ]]; then
    exit "$rc"
fi

template_role="${ROLE}Template"
step "role $template_role: ${template_privs[*]}"
rc=0
pveum_idempotent role add "$template_role" --privs "$(join_by , "${template_privs[@]}")" || rc=$?
if [[ $rc -eq 3 ]]; then
    pveum_idempotent role modify "$template_role" --privs "$(join_by , "${template_privs[@]}")"
elif [[ $rc -ne 0 ]]; then
    exit "$rc"
fi

step "pool $POOL"
rc=0
pveum_idempotent pool add "$POOL" --comment "BigFleet-managed VMs" || rc=$?
[[ $rc -eq 0 || $rc -eq 3 ]] || exit "$rc"

step "user $USER_ID"
rc=0
pveum_idempotent user add "$USER_ID" --comment "BigFleet capacity provider (API token only)" || rc=$?
[[ $rc -eq 0 || $rc -eq 3 ]] || exit "$rc"

# ACLs. `acl modify` sets an entry, so re-running it changes nothing.
step "ACL /pool/$POOL -> $ROLE"
pveum_idempotent acl modify "/pool/$POOL" --users "$USER_ID" --roles "$ROLE" --propagate 1
for id in "${template_ids[@]}"; do
    step "ACL /vms/$id -> $template_role"
    pveum_idempotent acl modify "/vms/$id" --users "$USER_ID" --roles "$template_role" --propagate 0
done
for s in "${storage_ids[@]}"; do
    # Only the Datastore.* privileges of the role have meaning on a storage path.
    step "ACL /storage/$s -> $ROLE"
    pveum_idempotent acl modify "/storage/$s" --users "$USER_ID" --roles "$ROLE" --propagate 0
done
# GET /nodes status and the nodes' certificate fingerprints.
step "ACL /nodes -> PVEAuditor"
pveum_idempotent acl modify /nodes --users "$USER_ID" --roles PVEAuditor --propagate 1
for m in "${pci_ids[@]}"; do
    # Mapping.Use (and Mapping.Audit, to list it) on the mapping only.
    step "ACL /mapping/pci/$m -> PVEMappingUser"
    pveum_idempotent acl modify "/mapping/pci/$m" --users "$USER_ID" --roles PVEMappingUser --propagate 0
done
# The zone PVE checks a NIC on bridge $1 in (pve-guest-common
# check_vnet_access): an SDN VNet's own zone, else localnetwork. Reading a
# VNet that does not exist (a plain bridge) fails, as does the whole /cluster/sdn
# tree without SDN installed: both mean localnetwork.
bridge_zone() {
    local vnet zone=""
    if [[ -n $SDN_ZONE ]]; then
        printf '%s' "$SDN_ZONE"
        return
    fi
    if command -v pvesh >/dev/null 2>&1 && vnet=$(pvesh get "/cluster/sdn/vnets/$1" --output-format json 2>/dev/null); then
        # {"digest":"...","type":"vnet","vnet":"vnet1","zone":"zone1"}
        zone=$(printf '%s' "$vnet" | sed -n 's/.*"zone"[[:space:]]*:[[:space:]]*"\([^"]*\)".*/\1/p')
    fi
    printf '%s' "${zone:-localnetwork}"
}

if [[ $PVE_MAJOR -ge 8 ]]; then
    # Since 8.0 cloning a VM whose NIC sits on a bridge needs SDN.Use on it,
    # in the bridge's zone; the grant propagates to the VLANs below it (a
    # NIC's tag and trunks).
    for b in "${bridge_ids[@]}"; do
        zone=$(bridge_zone "$b")
        step "ACL /sdn/zones/$zone/$b -> PVESDNUser"
        pveum_idempotent acl modify "/sdn/zones/$zone/$b" --users "$USER_ID" --roles PVESDNUser --propagate 1
    done
fi

# The token shares the user's privileges (--privsep 0), so the ACLs above are
# its whole reach.
token_id="$USER_ID!$TOKEN_NAME"
if [[ $ROTATE -eq 1 ]]; then
    step "rotating token $token_id"
    # A token that does not exist yet is fine here; any other failure shows
    # up as "already exists" on the add below.
    pveum user token remove "$USER_ID" "$TOKEN_NAME" >/dev/null 2>&1 || true
fi
step "token $token_id"
rc=0
out=$(pveum user token add "$USER_ID" "$TOKEN_NAME" --privsep 0 \
    --comment "BigFleet capacity provider" --output-format json 2>&1) || rc=$?
if [[ $rc -ne 0 ]]; then
    if [[ $out == *"already exists"* && $ROTATE -eq 1 ]]; then
        die "token $token_id could not be removed for rotation: $out"
    fi
    if [[ $out == *"already exists"* ]]; then
        printf '\nToken %s already exists; its secret was shown once, when it was created.\n' "$token_id"
        printf 'Re-run with --rotate-token to replace it (the old secret stops working).\n'
        exit 0
    fi
    printf '%s\n' "$out" >&2
    die "pveum user token add failed (exit $rc)"
fi
# {"full-tokenid":"bigfleet@pve!autoscaler","info":{"privsep":"0"},"value":"<uuid>"}
secret=$(printf '%s' "$out" | sed -n 's/.*"value"[[:space:]]*:[[:space:]]*"\([^"]*\)".*/\1/p')
[[ -n $secret ]] || die "could not read the token secret from pveum's answer"

if [[ -n $SECRET_FILE ]]; then
    (umask 077 && printf '%s' "$secret" >"$SECRET_FILE")
fi

cat <<EOF

Token created. The secret is shown only this once: store it now.
  token id:     $token_id
  token secret: $secret

Provider flags:
  --proxmox-token-id '$token_id' --proxmox-token-file <file holding the secret>
  --proxmox-pool $POOL --template-vmid ${template_ids[0]}
EOF
