#!/usr/bin/env bash
# PostgreSQL for the tests of redeliver-postgres: 127.0.0.1:5432, trust authentication, a
# database `test` (DATABASE_URL=postgres://postgres@127.0.0.1:5432/test, the tests' default).
#
#   bash scripts/postgres.sh up      # start it; install it from Debian's packages if missing
#   bash scripts/postgres.sh status  # exit 0 when it answers
#
# What `up` changes, and only when needed: installs the `postgresql` package, starts the
# cluster, trusts local and 127.0.0.1 connections, creates the database `test`. A machine that
# already runs it (as a developer machine may) is left as it is.
set -euo pipefail

host=127.0.0.1
port=5432

answers() {
  pg_isready -q -h "$host" -p "$port" 2>/dev/null
}

wait_for() {
  for _ in $(seq 1 60); do
    answers && return 0
    sleep 0.5
  done
  return 1
}

install() {
  echo "postgres: installing PostgreSQL from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql >/dev/null
}

cluster_version() {
  ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1
}

trust_local() {
  local hba="/etc/postgresql/$1/main/pg_hba.conf"
  if ! grep -Eq '^host\s+all\s+all\s+127\.0\.0\.1/32\s+trust' "$hba"; then
    echo "postgres: trusting connections from 127.0.0.1 (tests only)"
    # First match wins in pg_hba.conf: the trust lines go before the packaged ones.
    sed -i '1i local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
    pg_ctlcluster --skip-systemctl-redirect "$1" main reload || true
  fi
}

up() {
  if answers; then
    ensure_database
    return 0
  fi
  command -v pg_ctlcluster >/dev/null || install
  local v
  v=$(cluster_version)
  if [ -z "$v" ]; then
    echo "postgres: no cluster after installing postgresql" >&2
    exit 1
  fi
  trust_local "$v"
  echo "postgres: starting cluster $v/main"
  pg_ctlcluster --skip-systemctl-redirect "$v" main start || true
  if ! wait_for; then
    echo "postgres: PostgreSQL $v does not answer on $host:$port" >&2
    exit 1
  fi
  ensure_database
}

ensure_database() {
  if ! psql -h "$host" -p "$port" -U postgres -d test -Atc 'select 1' >/dev/null 2>&1; then
    echo "postgres: creating the database test"
    psql -h "$host" -p "$port" -U postgres -d postgres -c 'create database test' >/dev/null
  fi
}

case "${1:-}" in
  up) up ;;
  status) answers ;;
  *)
    echo "usage: $0 up|status" >&2
    exit 2
    ;;
esac
