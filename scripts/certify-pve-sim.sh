#!/usr/bin/env bash
# Certify the REAL Proxmox backend end to end: boot pve-sim (the Proxmox VE
# API simulator), point the provider at it over verified TLS with an API
# token, and run the certification lanes core, cloud and durable; then run
# docs/certification.md's "Certifying a real endpoint" recipe as written.
# Each lane group gets a fresh simulator so VMs from one do not occupy the
# slots of the next. The simulated guest has no Kubernetes: the bootstrap
# hook is /bin/true and the drain command a no-op echo; the readiness gate is
# exercised by the fault lane and the pve-sim integration tests instead.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-${CARGO_TARGET_DIR:-target}/debug}
OUT=${OUT:-reports/pve-sim}
mkdir -p "$OUT"
work=$(mktemp -d)
sim_pid=""
recipe_pid=""
cleanup() {
  if [ -n "$recipe_pid" ]; then kill "$recipe_pid" 2>/dev/null || true; wait "$recipe_pid" 2>/dev/null || true; fi
  if [ -n "$sim_pid" ]; then kill "$sim_pid" 2>/dev/null || true; wait "$sim_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# start_sim [POOLS]: a fresh simulator with the pools named (default: bigfleet).
start_sim() {
  if [ -n "$sim_pid" ]; then kill "$sim_pid"; wait "$sim_pid" 2>/dev/null || true; fi
  : > "$work/sim.log"
  "$BIN/pve-sim" --listen 127.0.0.1:0 --nodes pve1,pve2 --templates 9000:shared \
    --pools "${1:-bigfleet}" \
    --ca-out "$work/ca.pem" --clone-duration 200ms --agent-boot-delay 300ms \
    --max-parallel-local-clones 0 >"$work/sim.log" 2>&1 &
  sim_pid=$!
  for _ in $(seq 1 200); do
    if grep -q '^base_url:' "$work/sim.log"; then break; fi
    if ! kill -0 "$sim_pid" 2>/dev/null; then cat "$work/sim.log" >&2; echo "pve-sim exited" >&2; exit 1; fi
    sleep 0.05
  done
  url=$(sed -n 's/^base_url: //p' "$work/sim.log")
  secret=$(sed -n 's/^token_secret: //p' "$work/sim.log")
  token=$(sed -n 's/^token_id: //p' "$work/sim.log")
  if [ -z "$url" ]; then cat "$work/sim.log" >&2; echo "pve-sim did not report its URL" >&2; exit 1; fi
  printf '%s\n' "$secret" >"$work/token"
  chmod 600 "$work/token"
}

certify() {
  local profile=$1 out=$2
  "$BIN/bfconformance" --provider proxmox --provider-bin "$BIN/bigfleet-proxmox" \
    --profile "$profile" --seed-count 256 --out "$out" ${SEED:+--seed "$SEED"} \
    --provider-arg=--use-fake-backend=false \
    "--provider-arg=--proxmox-api-url=$url" \
    "--provider-arg=--proxmox-token-id=$token" \
    "--provider-arg=--proxmox-token-file=$work/token" \
    "--provider-arg=--proxmox-ca-file=$work/ca.pem" \
    --provider-arg=--nodes=pve1,pve2 \
    --provider-arg=--readiness-command= \
    --provider-arg=--proxmox-poll-interval=50ms \
    --provider-arg=--max-parallel-clones=16 \
    --provider-arg=--bootstrap-exec=/bin/true \
    "--provider-arg=--drain-command=echo drained"
}

# The sh block of docs/certification.md's "Certifying a real endpoint" whose
# text contains $1, continuation lines joined.
recipe_command() {
  awk -v want="$1" '
    /^## Certifying a real endpoint/ { in_section = 1; next }
    in_section && /^## / { in_section = 0 }
    in_section && /^```sh/ { in_block = 1; block = ""; next }
    in_section && in_block && /^```/ { in_block = 0; if (index(block, want)) print block; next }
    in_block { line = $0; sub(/\\$/, "", line); block = block line " " }
  ' docs/certification.md
}

# The documented recipe, run as written against pve-sim: only the
# cluster's address, the token and CA files, the state file and the
# binaries' directory are this run's; the listener takes a free port.
certify_recipe() {
  local boot harness log="$OUT/recipe-provider.log" addr=""
  boot=$(recipe_command 'target/release/bigfleet-proxmox')
  harness=$(recipe_command 'target/release/bfconformance')
  if [ -z "$boot" ] || [ -z "$harness" ]; then
    echo "docs/certification.md has no boot or harness command in 'Certifying a real endpoint'" >&2
    exit 1
  fi
  boot=${boot//target\/release\//$BIN/}
  boot=${boot//https:\/\/pve1.example.internal:8006\/api2\/json/$url}
  boot=${boot//.\/token/$work/token}
  boot=${boot//.\/pve-root-ca.pem/$work/ca.pem}
  boot=${boot//.\/certify-state.db/$work/recipe-state.db}
  boot=${boot//127.0.0.1:9099/127.0.0.1:0}
  boot=${boot//127.0.0.1:9098/127.0.0.1:0}
  harness=${harness//target\/release\//$BIN/}
  # exec: the background job is the provider itself, not a shell that
  # runs it, so killing $! stops the provider (a killed shell would leave
  # it running, orphaned, after the run).
  eval "exec $boot" >"$log" 2>&1 &
  recipe_pid=$!
  for _ in $(seq 1 600); do
    addr=$(sed -n 's/.*msg="serving CapacityProvider" addr=\([^ ]*\).*/\1/p' "$log")
    if [ -n "$addr" ]; then break; fi
    if ! kill -0 "$recipe_pid" 2>/dev/null; then cat "$log" >&2; echo "the recipe's provider exited" >&2; exit 1; fi
    sleep 0.05
  done
  if [ -z "$addr" ]; then cat "$log" >&2; echo "the recipe's provider never served" >&2; exit 1; fi
  harness=${harness//127.0.0.1:9099/$addr}
  local rc=0
  eval "$harness --out $OUT/recipe" || rc=$?
  kill "$recipe_pid" 2>/dev/null || true
  wait "$recipe_pid" 2>/dev/null || true
  recipe_pid=""
  # Nothing the recipe started outlives it. (The bracket keeps this grep's
  # own command line from matching.)
  if grep -lsE "$work/recipe-state[.]db" /proc/[0-9]*/cmdline >/dev/null; then
    echo "the recipe's provider outlived its kill" >&2
    exit 1
  fi
  if [ "$rc" -ne 0 ]; then echo "the certify-a-real-endpoint recipe failed against pve-sim" >&2; exit "$rc"; fi
}

start_sim
certify core,cloud "$OUT/core-cloud"
start_sim
certify durable "$OUT/durable"
start_sim bigfleet-certify
certify_recipe
echo "CERTIFIED: the real Proxmox backend passed core, cloud and durable against pve-sim, and docs/certification.md's certify-a-real-endpoint recipe runs as written"
