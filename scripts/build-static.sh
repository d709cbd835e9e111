#!/usr/bin/env bash
# The one way the provider's static (musl) binary and the image's root
# filesystem are built: deploy/Dockerfile's builder stage runs it, and so does
# `make image-rootfs`, so the image and what CI proves cannot drift apart.
#
#   scripts/build-static.sh build         release build for <arch>-unknown-linux-musl
#   scripts/build-static.sh rootfs DIR    build, refuse a binary that is not static,
#                                         and stage the image's files under DIR
#
# Run from the repository root. Honours CARGO_TARGET_DIR as cargo does.
# CA_BUNDLE overrides the CA bundle copied into the image (default: Debian's).
# Staging as root also gives /var/lib/bigfleet to uid 65532, as the image has it
# (the Dockerfile's COPY --chown does the same inside an image build).
set -euo pipefail

usage() {
  echo "usage: $0 build | rootfs DIR" >&2
  exit 2
}

# The runtime user of the image: no login, home on the state directory.
readonly RUNTIME_UID=65532
TARGET="$(uname -m)-unknown-linux-musl"
readonly TARGET
readonly CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

build() {
  # rustup is asked only when the target is missing, so a machine that has it
  # installed builds without reaching the network.
  if ! rustup target list --installed | grep -qx "$TARGET"; then
    rustup target add "$TARGET"
  fi
  # musl-gcc compiles the C parts of the dependency tree (bundled SQLite, ring).
  if ! command -v musl-gcc >/dev/null; then
    echo "musl-gcc is missing: install Debian's musl-tools" >&2
    exit 1
  fi
  cargo build --release --locked -p bigfleet-proxmox --target "$TARGET"
}

# Prints the path of the built binary.
binary() {
  echo "${CARGO_TARGET_DIR:-target}/$TARGET/release/bigfleet-proxmox"
}

# A binary with a program interpreter (PT_INTERP) or NEEDED libraries would
# not start on an image without a libc.
check_static() {
  local bin="$1"
  if readelf -lW "$bin" | grep -q 'INTERP'; then
    echo "$bin is dynamically linked (it has a program interpreter)" >&2
    exit 1
  fi
  if readelf -dW "$bin" | grep -q '(NEEDED)'; then
    echo "$bin needs shared libraries:" >&2
    readelf -dW "$bin" | grep '(NEEDED)' >&2
    exit 1
  fi
}

rootfs() {
  local out="$1" bin
  build
  bin="$(binary)"
  check_static "$bin"
  rm -rf "$out"
  mkdir -p "$out/usr/local/bin" "$out/etc/ssl/certs" "$out/var/lib/bigfleet"
  cp "$bin" "$out/usr/local/bin/bigfleet-proxmox"
  cp "$CA_BUNDLE" "$out/etc/ssl/certs/ca-certificates.crt"
  echo "nonroot:x:$RUNTIME_UID:$RUNTIME_UID:nonroot:/var/lib/bigfleet:/sbin/nologin" >"$out/etc/passwd"
  echo "nonroot:x:$RUNTIME_UID:" >"$out/etc/group"
  if [ "$(id -u)" = 0 ]; then
    chown "$RUNTIME_UID:$RUNTIME_UID" "$out/var/lib/bigfleet"
  fi
  echo "staged the image's root filesystem in $out"
}

case "${1:-}" in
  build)
    [ $# -eq 1 ] || usage
    build
    ;;
  rootfs)
    [ $# -eq 2 ] || usage
    rootfs "$2"
    ;;
  *) usage ;;
esac
