#!/usr/bin/env bash
# Provide RabbitMQ 4.3.6 (Debian sid) and 4.0.5 (Debian 13, trixie) on this machine, next to the
# system's 3.10.8, each in a chroot of its own made with debootstrap from the Debian archive apt
# already uses here. Idempotent: a chroot that exists is reused, a node that answers is left alone.
#
# usage: scripts/rabbitmq4.sh [up | provision | start | stop | status | ctl NAME ARGS...]
#   up          provision what is missing, start what is not running, wait until each answers (default)
#   provision   only build the chroots
#   start       start the nodes (provisions first if needed)
#   stop        stop the nodes (the chroots and their data stay)
#   status      one line a node: version, ports, answering or not
#   ctl NAME …  rabbitmqctl inside chroot NAME (rabbit4 or rabbit40), e.g. `ctl rabbit4 list_queues`
#
# nodes (NAME  version  AMQP / management / Erlang distribution port):
#   rabbit4   4.3.6 from sid      5673 / 15673 / 25673
#   rabbit40  4.0.5 from trixie   5674 / 15674 / 25674
# The chroots live in $REDELIVER_BROKERS_DIR (default /var/lib/redeliver-brokers), outside any
# checkout, so a fresh clone (CI) finds them ready. Both nodes share the host's epmd.
#
# No TLS listener: the TLS tests start a node of their own, of the same version when
# RD_CLUSTER_CHROOT names one of these chroots (crates/testkit/src/fixtures.rs).
set -euo pipefail

ROOT=${REDELIVER_BROKERS_DIR:-/var/lib/redeliver-brokers}
NODES="rabbit4 rabbit40"

suite_of() { case $1 in rabbit4) echo sid ;; rabbit40) echo trixie ;; esac; }
port_of() { case $1 in rabbit4) echo 5673 ;; rabbit40) echo 5674 ;; esac; }
mgmt_of() { echo $(($(port_of "$1") + 10000)); }
dist_of() { echo $(($(port_of "$1") + 20000)); }

log() { echo "rabbitmq4: $*" >&2; }

# The Debian archive this machine's apt uses: the first `URIs:` (deb822) or `deb` line whose
# path ends in /debian.
mirror() {
  local m
  m=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
    sed -n 's|^URIs:[[:space:]]*\([^[:space:]]*/debian\)/\{0,1\}$|\1|p' | head -n 1)
  if [ -z "$m" ]; then
    m=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
      sed -n 's|^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]\{1,\}\)\{0,1\}\([^[:space:]]*/debian\)/\{0,1\}[[:space:]].*|\2|p' |
      head -n 1)
  fi
  if [ -z "$m" ]; then
    log "cannot find the Debian archive in /etc/apt/sources.list*; set REDELIVER_DEBIAN_MIRROR"
    return 1
  fi
  echo "${REDELIVER_DEBIAN_MIRROR:-$m}"
}

mount_fs() { # proc, dev and sys inside the chroot (Erlang and apt need them)
  local dir=$1
  mountpoint -q "$dir/proc" || mount -t proc proc "$dir/proc"
  mountpoint -q "$dir/dev" || mount --bind /dev "$dir/dev"
  mountpoint -q "$dir/sys" || mount --bind /sys "$dir/sys"
}

provision_one() {
  local name=$1 suite dir tmp
  suite=$(suite_of "$name")
  dir="$ROOT/$name"
  if [ -x "$dir/usr/lib/rabbitmq/bin/rabbitmq-server" ]; then return 0; fi
  tmp="$dir.partial"
  if [ -d "$tmp" ]; then
    for m in proc dev sys; do umount "$tmp/$m" 2>/dev/null || true; done
    rm -rf "$tmp"
  fi
  mkdir -p "$ROOT"
  log "$name: debootstrap $suite into $tmp (a few minutes)"
  debootstrap --variant=minbase "$suite" "$tmp" "$(mirror)" >"$ROOT/$name.debootstrap.log" 2>&1 || {
    tail -n 20 "$ROOT/$name.debootstrap.log" >&2
    return 1
  }
  # Without the host's hosts file the node cannot resolve `localhost` and dies with nxdomain.
  cp /etc/hosts /etc/resolv.conf "$tmp/etc/"
  # Packages must not start services inside the chroot: we start the node ourselves.
  printf '#!/bin/sh\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
  chmod +x "$tmp/usr/sbin/policy-rc.d"
  mount_fs "$tmp"
  log "$name: apt-get install rabbitmq-server"
  # sid's Release file is past its Valid-Until date; the archive's signature is still checked.
  chroot "$tmp" apt-get -qq -o Acquire::Check-Valid-Until=false update >/dev/null
  chroot "$tmp" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends rabbitmq-server >"$ROOT/$name.apt.log" 2>&1 || {
    tail -n 20 "$ROOT/$name.apt.log" >&2
    return 1
  }
  for m in proc dev sys; do umount "$tmp/$m" 2>/dev/null || true; done
  mv "$tmp" "$dir"
  log "$name: $(basename "$(ls -d "$dir"/usr/lib/rabbitmq/lib/rabbitmq_server-*)") ready in $dir"
}

provision_all() { # both downloads at once: they are network-bound
  local n pids=""
  for n in $NODES; do
    [ -x "$ROOT/$n/usr/lib/rabbitmq/bin/rabbitmq-server" ] || pids=x
  done
  [ -n "$pids" ] || return 0
  if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  pids=""
  for n in $NODES; do provision_one "$n" & pids="$pids $!"; done
  for p in $pids; do wait "$p"; done
}

write_config() {
  local name=$1 dir port mgmt
  dir="$ROOT/$name"
  port=$(port_of "$name")
  mgmt=$(mgmt_of "$name")
  mkdir -p "$dir/etc/rabbitmq"
  {
    echo "# written by scripts/rabbitmq4.sh"
    echo "listeners.tcp.default = 127.0.0.1:$port"
    echo "management.tcp.port = $mgmt"
    echo "management.tcp.ip = 127.0.0.1"
  } >"$dir/etc/rabbitmq/rabbitmq.conf.new"
  mv "$dir/etc/rabbitmq/rabbitmq.conf.new" "$dir/etc/rabbitmq/rabbitmq.conf"
  # Enabling plugins offline: the file the node reads at boot.
  echo '[rabbitmq_management].' >"$dir/etc/rabbitmq/enabled_plugins"
}

in_chroot() { # in_chroot NAME cmd...: run a RabbitMQ tool inside the chroot with the node's env
  local name=$1
  shift
  chroot "$ROOT/$name" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    RABBITMQ_NODENAME="$name@localhost" \
    RABBITMQ_NODE_PORT="$(port_of "$name")" \
    RABBITMQ_DIST_PORT="$(dist_of "$name")" \
    "$@"
}

answers() { # the management API answers and the AMQP port accepts connections
  local name=$1
  curl -fsS -m 5 -u guest:guest "http://127.0.0.1:$(mgmt_of "$name")/api/overview" >/dev/null 2>&1 &&
    (exec 3<>"/dev/tcp/127.0.0.1/$(port_of "$name")") 2>/dev/null
}

start_one() {
  local name=$1 dir
  dir="$ROOT/$name"
  provision_one "$name"
  if answers "$name"; then
    # Configured with an amqps listener by an older version of this script: restart without.
    if grep -q '^listeners.ssl' "$dir/etc/rabbitmq/rabbitmq.conf" 2>/dev/null; then
      log "$name: restarting without its old TLS listener"
      stop_one "$name"
    else
      return 0
    fi
  fi
  write_config "$name"
  mount_fs "$dir"
  if in_chroot "$name" rabbitmqctl -q ping >/dev/null 2>&1; then
    # The VM runs but does not serve (its app was stopped by a test): start the app.
    in_chroot "$name" rabbitmqctl -q start_app >/dev/null 2>&1 || true
  else
    log "$name: starting on $(port_of "$name") (management $(mgmt_of "$name"))"
    in_chroot "$name" rabbitmq-server -detached >/dev/null 2>&1 ||
      in_chroot "$name" sh -c 'setsid rabbitmq-server >/var/log/rabbitmq/console.log 2>&1 </dev/null &'
  fi
}

wait_one() {
  local name=$1
  for _ in $(seq 1 180); do
    if answers "$name"; then
      log "$name: up (AMQP $(port_of "$name"), management $(mgmt_of "$name"))"
      return 0
    fi
    sleep 1
  done
  log "$name: did not answer within 180 s; its logs are in $ROOT/$name/var/log/rabbitmq"
  tail -n 30 "$ROOT/$name"/var/log/rabbitmq/*.log >&2 2>/dev/null || true
  return 1
}

stop_one() {
  local name=$1
  [ -d "$ROOT/$name" ] || return 0
  mount_fs "$ROOT/$name"
  in_chroot "$name" rabbitmqctl -q stop >/dev/null 2>&1 || true
}

cmd=${1:-up}
case $cmd in
  provision) provision_all ;;
  up | start)
    provision_all
    for n in $NODES; do start_one "$n"; done
    for n in $NODES; do wait_one "$n"; done
    ;;
  stop) for n in $NODES; do stop_one "$n"; done ;;
  status)
    for n in $NODES; do
      if answers "$n"; then state=up; else state=down; fi
      echo "$n $(suite_of "$n") amqp=$(port_of "$n") management=$(mgmt_of "$n") $state"
    done
    ;;
  ctl)
    name=${2:?usage: scripts/rabbitmq4.sh ctl rabbit4|rabbit40 ARGS...}
    shift 2
    mount_fs "$ROOT/$name"
    in_chroot "$name" rabbitmqctl "$@"
    ;;
  *)
    echo "usage: $0 [up|provision|start|stop|status|ctl NAME ARGS...]" >&2
    exit 2
    ;;
esac
