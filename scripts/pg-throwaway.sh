#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for the tests of the PostgreSQL state store:
# `initdb` into a temporary directory as a non-root user, listening on
# 127.0.0.1 only (and a socket inside that directory), on a free port. With
# openssl (Debian's postgresql depends on it) it also speaks TLS with a
# certificate for 127.0.0.1 from a CA made for the run; the URL names that
# CA (`sslrootcert=`) so tests can connect with sslmode=verify-full.
#
#   scripts/pg-throwaway.sh run -- COMMAND...   start, run COMMAND with
#       BIGFLEET_TEST_POSTGRES_URL set, stop (also on failure or Ctrl-C)
#   scripts/pg-throwaway.sh start DIR           start one in DIR (created
#       empty) and print its URL (also written to DIR/url)
#   scripts/pg-throwaway.sh restart DIR         restart it (fast shutdown: open
#       connections are cut), with the options it was started with
#   scripts/pg-throwaway.sh halt DIR            stop the server, keep DIR (an
#       outage); `resume DIR` starts it again on the same port
#   scripts/pg-throwaway.sh stop DIR            stop it and remove DIR
#   scripts/pg-throwaway.sh bindir              where initdb and pg_ctl are
#
# `run` with BIGFLEET_TEST_POSTGRES_URL already set only runs COMMAND (the
# caller provides a database). Without PostgreSQL's server binaries, `run`
# fails under CI=true and otherwise runs COMMAND without the URL, so those
# tests skip and say how to run them. Debian: `apt-get install postgresql`.
# initdb refuses to run as root: as root, the cluster runs as $PG_USER
# (default `postgres`, which Debian's package creates; else `nobody`).
set -euo pipefail

# The directory of initdb and pg_ctl: $PG_BINDIR, pg_config's answer, or the
# newest Debian install under /usr/lib/postgresql. Every `return` names its
# status: in the EXIT trap a bare one would return the status the script
# exits with.
pg_bindir() {
  if [ -n "${PG_BINDIR:-}" ]; then
    echo "$PG_BINDIR"
    return 0
  fi
  if command -v pg_config >/dev/null && [ -x "$(pg_config --bindir)/initdb" ]; then
    pg_config --bindir
    return 0
  fi
  local newest=""
  for dir in /usr/lib/postgresql/*/bin; do
    if [ -x "$dir/initdb" ]; then newest="$dir"; fi
  done
  if [ -n "$newest" ]; then
    echo "$newest"
    return 0
  fi
  if command -v initdb >/dev/null; then
    dirname "$(command -v initdb)"
    return 0
  fi
  return 1
}

# Run a command as the cluster's owner (this user unless we are root).
as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u "$(owner)" -- "$@"
  else
    "$@"
  fi
}

owner() {
  if [ -n "${PG_USER:-}" ]; then
    echo "$PG_USER"
  elif id postgres >/dev/null 2>&1; then
    echo postgres
  else
    echo nobody
  fi
}

# A TCP port nobody listens on now (the kernel's pick; released at once).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

start() {
  local dir=$1 bin port
  bin=$(pg_bindir) || {
    echo "pg-throwaway: PostgreSQL server binaries (initdb) not found; install them (Debian: apt-get install postgresql)" >&2
    return 1
  }
  mkdir -p "$dir"
  if [ "$(id -u)" = 0 ]; then chown "$(owner)" "$dir"; fi
  as_owner "$bin/initdb" -D "$dir/data" -U bigfleet --auth=trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 || {
    cat "$dir/initdb.log" >&2
    return 1
  }
  local tls="" ca=""
  if command -v openssl >/dev/null && make_certificates "$dir" >"$dir/openssl.log" 2>&1; then
    tls="-c ssl=on -c ssl_cert_file=$dir/server.crt -c ssl_key_file=$dir/server.key"
    ca="&sslrootcert=$dir/ca.pem"
  fi
  # A port taken between the pick and the bind fails the start: pick again.
  local attempt
  for attempt in 1 2 3; do
    port=$(free_port)
    # Kept for `resume`, which starts the server again as it was.
    echo "-c listen_addresses=127.0.0.1 -p $port -k $dir/data -c max_connections=200 $tls" >"$dir/options"
    if as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/data/server.log" -w -t 60 \
      -o "$(cat "$dir/options")" start >/dev/null; then
      echo "postgres://bigfleet@127.0.0.1:$port/postgres?sslmode=disable$ca" >"$dir/url"
      cat "$dir/url"
      return 0
    fi
    echo "pg-throwaway: start attempt $attempt on port $port failed:" >&2
    tail -5 "$dir/data/server.log" >&2 || true
  done
  return 1
}

# A CA for this run and a server certificate for 127.0.0.1 signed by it
# (P-256 keys: quick to make), owned by the cluster's owner.
make_certificates() {
  local dir=$1
  printf '%s\n' 'subjectAltName=IP:127.0.0.1,DNS:localhost' 'basicConstraints=critical,CA:FALSE' \
    'keyUsage=critical,digitalSignature' 'extendedKeyUsage=serverAuth' >"$dir/server.ext"
  as_owner openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=bigfleet throwaway CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign
  as_owner openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=127.0.0.1" -keyout "$dir/server.key" -out "$dir/server.csr"
  as_owner openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 2 -extfile "$dir/server.ext" -out "$dir/server.crt"
  as_owner chmod 0600 "$dir/server.key"
}

stop() {
  local dir=$1 bin
  if [ -f "$dir/data/postmaster.pid" ] && bin=$(pg_bindir); then
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null || true
  fi
  rm -rf "$dir"
}

restart() {
  local dir=$1 bin
  bin=$(pg_bindir) || return 1
  # pg_ctl restart reuses the options of the last start (postmaster.opts).
  as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/data/server.log" -m fast -w -t 60 restart >/dev/null
}

# Stop the server and keep its data (an outage), then start it again on
# the same port with the same options.
halt() {
  local dir=$1 bin
  bin=$(pg_bindir) || return 1
  as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null
}

resume() {
  local dir=$1 bin
  bin=$(pg_bindir) || return 1
  as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/data/server.log" -w -t 60 \
    -o "$(cat "$dir/options")" start >/dev/null
}

run() {
  if [ "${1:-}" = "--" ]; then shift; fi
  if [ $# = 0 ]; then
    echo "usage: $0 run -- COMMAND..." >&2
    return 2
  fi
  if [ -n "${BIGFLEET_TEST_POSTGRES_URL:-}" ]; then
    "$@"
    return
  fi
  if ! pg_bindir >/dev/null; then
    if [ "${CI:-}" = true ]; then
      echo "pg-throwaway: CI=true and PostgreSQL's server binaries are missing (Debian: apt-get install postgresql)" >&2
      return 1
    fi
    echo "pg-throwaway: no PostgreSQL server binaries: the PostgreSQL store tests will skip (Debian: apt-get install postgresql)" >&2
    "$@"
    return
  fi
  local dir
  dir=$(mktemp -d "${TMPDIR:-/tmp}/bigfleet-pg.XXXXXX")
  # Traps name the directory by value: it is set once, here.
  # shellcheck disable=SC2064
  trap "stop '$dir'" EXIT
  trap 'exit 130' INT TERM
  BIGFLEET_TEST_POSTGRES_URL=$(start "$dir")
  export BIGFLEET_TEST_POSTGRES_URL
  echo "pg-throwaway: PostgreSQL at $BIGFLEET_TEST_POSTGRES_URL (data in $dir)" >&2
  "$@"
}

case "${1:-}" in
  run) shift; run "$@" ;;
  start) start "${2:?usage: $0 start DIR}" ;;
  restart) restart "${2:?usage: $0 restart DIR}" ;;
  halt) halt "${2:?usage: $0 halt DIR}" ;;
  resume) resume "${2:?usage: $0 resume DIR}" ;;
  stop) stop "${2:?usage: $0 stop DIR}" ;;
  bindir) pg_bindir ;;
  *)
    echo "usage: $0 run -- COMMAND... | start DIR | restart DIR | halt DIR | resume DIR | stop DIR | bindir" >&2
    exit 2
    ;;
esac
