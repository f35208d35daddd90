#!/usr/bin/env bash
# Start, stop and inspect extra RabbitMQ nodes on this machine, for the reliability suite:
# a 3-node cluster (the default) or a dedicated single node (RD_CLUSTER_NODES=1), each with its
# own node name, ports and data directory under /tmp.
#
# The machine's default node (rabbit@localhost on 5672 / 15672 / 25672) is never touched: every
# node started here has its own name, its own rabbitmq-env.conf (so the system one, which pins
# NODENAME=rabbit@localhost, is not read) and its own rabbitmq.conf (so the system listener on
# 5672 is not reused).
#
# usage: scripts/cluster.sh start | stop | status | clean | stop-node I | start-node I | urls
#
#   start          start every node (in parallel) and join nodes 2..N to node 1; idempotent
#   stop           stop every node (data kept, so `start` brings the same cluster back)
#   clean          stop, then delete the data directories
#   status         ping every node and print the cluster status
#   stop-node I    stop node I only (the fault the cluster test injects)
#   start-node I   start node I again; it rejoins the cluster on its own
#   urls           print the AMQP URLs, comma-separated (what the tests pass to the worker)
#   ctl I ARGS...  rabbitmqctl ARGS against node I (as the user whose cookie the nodes share)
#
# settings (environment):
#   RD_CLUSTER_NAME       node name stem                       default rdcluster
#   RD_CLUSTER_NODES      number of nodes                      default 3
#   RD_CLUSTER_BASE_PORT  AMQP port of node 1 (node I: +I-1)   default 5681
#                         management: +10000, Erlang distribution: +20000
#   RD_CLUSTER_DIR        data, logs and config                default /tmp/redeliver-$RD_CLUSTER_NAME
#   RD_CLUSTER_MANAGEMENT 1 to enable the management plugin    default 1
#   RD_CLUSTER_CHROOT     run the nodes with the RabbitMQ of this chroot (scripts/rabbitmq4.sh
#                         makes them: /var/lib/redeliver-brokers/rabbit4 is 4.3.6)  default: the system's
#   RD_CLUSTER_TLS_DIR    a directory with ca.pem, server.pem and server.key: node I also listens
#                         for amqps on its AMQP port + 1000 and accepts SASL EXTERNAL (client
#                         certificate CN = user name)                               default: no TLS
#
# Node I is named $RD_CLUSTER_NAME-I@localhost; `rabbitmqctl -n rdcluster-1@localhost ...` talks
# to it. Run as root (the nodes then run as the rabbitmq user, sharing its Erlang cookie with
# rabbitmqctl) or as the user that owns ~/.erlang.cookie.
set -euo pipefail

# Another RabbitMQ version lives in a chroot: run this very script inside it. The chroot shares
# the host's network and epmd, so the nodes' ports and names are the same as outside.
if [ -n "${RD_CLUSTER_CHROOT:-}" ] && [ -z "${RD_CLUSTER_IN_CHROOT:-}" ]; then
  root=$RD_CLUSTER_CHROOT
  [ -x "$root/usr/lib/rabbitmq/bin/rabbitmq-server" ] || {
    echo "RD_CLUSTER_CHROOT=$root holds no RabbitMQ (run scripts/rabbitmq4.sh provision)" >&2
    exit 1
  }
  mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
  mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
  mountpoint -q "$root/sys" || mount --bind /sys "$root/sys"
  mkdir -p "$root/opt/redeliver"
  cp "$0" "$root/opt/redeliver/cluster.sh"
  # The chroot does not see the host's files: the nodes get a copy of the TLS material.
  if [ -n "${RD_CLUSTER_TLS_DIR:-}" ]; then
    tls_copy="/opt/redeliver/tls-${RD_CLUSTER_NAME:-rdcluster}"
    mkdir -p "$root$tls_copy"
    cp "$RD_CLUSTER_TLS_DIR/ca.pem" "$RD_CLUSTER_TLS_DIR/server.pem" \
      "$RD_CLUSTER_TLS_DIR/server.key" "$root$tls_copy/"
    export RD_CLUSTER_TLS_DIR=$tls_copy
  fi
  exec chroot "$root" env RD_CLUSTER_IN_CHROOT=1 PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    bash /opt/redeliver/cluster.sh "$@"
fi

NAME=${RD_CLUSTER_NAME:-rdcluster}
NODES=${RD_CLUSTER_NODES:-3}
BASE_PORT=${RD_CLUSTER_BASE_PORT:-5681}
DIR=${RD_CLUSTER_DIR:-/tmp/redeliver-$NAME}
MANAGEMENT=${RD_CLUSTER_MANAGEMENT:-1}
TLS_DIR=${RD_CLUSTER_TLS_DIR:-}
HOST=localhost
RMQ_BIN=${RD_RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}
if [ ! -x "$RMQ_BIN/rabbitmq-server" ]; then
  # Not a Debian-style install: use whatever is on PATH.
  RMQ_BIN=$(dirname "$(command -v rabbitmq-server)")
fi

node_name() { echo "$NAME-$1@$HOST"; }
amqp_port() { echo $((BASE_PORT + $1 - 1)); }
mgmt_port() { echo $((BASE_PORT + 10000 + $1 - 1)); }
dist_port() { echo $((BASE_PORT + 20000 + $1 - 1)); }
tls_port() { echo $((BASE_PORT + 1000 + $1 - 1)); }
node_dir() { echo "$DIR/node-$1"; }

# Runs a RabbitMQ tool as the user whose Erlang cookie the nodes share. As root that is the
# rabbitmq user (the Debian package's layout: its cookie is /var/lib/rabbitmq/.erlang.cookie);
# otherwise the current user with ~/.erlang.cookie.
as_rabbit() {
  if [ "$(id -u)" = 0 ] && id rabbitmq >/dev/null 2>&1; then
    local home
    home=$(getent passwd rabbitmq | cut -d: -f6)
    # runuser keeps the environment we pass explicitly through `env`; HOME selects the cookie.
    runuser -u rabbitmq -- env HOME="$home" "$@"
  else
    "$@"
  fi
}

ctl() { # ctl I args...: rabbitmqctl against node I
  local i=$1; shift
  as_rabbit "$RMQ_BIN/rabbitmqctl" -n "$(node_name "$i")" "$@"
}

is_up() { # the node's Erlang VM answers (its app may still be booting)
  ctl "$1" -q ping >/dev/null 2>&1
}

write_config() { # per-node rabbitmq.conf, rabbitmq-env.conf and enabled_plugins
  local i=$1 d
  d=$(node_dir "$i")
  mkdir -p "$d/mnesia" "$d/log"
  cat >"$d/rabbitmq.conf" <<EOF
# generated by scripts/cluster.sh: node $(node_name "$i")
listeners.tcp.1 = 127.0.0.1:$(amqp_port "$i")
management.tcp.ip = 127.0.0.1
management.tcp.port = $(mgmt_port "$i")
# Several brokers share this machine: a fraction of the RAM each, or the first one to grow
# would raise a memory alarm for all of them.
vm_memory_high_watermark.relative = 0.1
# A stopped peer must be noticed within seconds, not the default minute, for the failover test.
net_ticktime = 10
EOF
  local plugins=()
  if [ "$MANAGEMENT" = 1 ]; then plugins+=(rabbitmq_management); fi
  if [ -n "$TLS_DIR" ]; then
    # The node reads its own copy (as the rabbitmq user), not the caller's directory.
    mkdir -p "$d/tls"
    cp "$TLS_DIR/ca.pem" "$TLS_DIR/server.pem" "$TLS_DIR/server.key" "$d/tls/"
    cat >>"$d/rabbitmq.conf" <<EOF
listeners.ssl.default = 127.0.0.1:$(tls_port "$i")
ssl_options.cacertfile = $d/tls/ca.pem
ssl_options.certfile = $d/tls/server.pem
ssl_options.keyfile = $d/tls/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
EOF
    plugins+=(rabbitmq_auth_mechanism_ssl)
  fi
  # Replaces /etc/rabbitmq/rabbitmq-env.conf (which names the default node) for this node.
  cat >"$d/rabbitmq-env.conf" <<EOF
NODENAME=$(node_name "$i")
NODE_PORT=$(amqp_port "$i")
DIST_PORT=$(dist_port "$i")
CONFIG_FILE=$d/rabbitmq.conf
MNESIA_BASE=$d/mnesia
LOG_BASE=$d/log
ENABLED_PLUGINS_FILE=$d/enabled_plugins
ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
  (
    IFS=,
    echo "[${plugins[*]}]." >"$d/enabled_plugins"
  )
  if [ "$(id -u)" = 0 ] && id rabbitmq >/dev/null 2>&1; then
    chown -R rabbitmq: "$DIR"
  fi
}

start_node() { # starts node I detached; returns at once
  local i=$1 d
  if is_up "$i"; then
    return 0
  fi
  if (exec 3<>"/dev/tcp/127.0.0.1/$(amqp_port "$i")") 2>/dev/null; then
    echo "port $(amqp_port "$i") is taken by something that is not $(node_name "$i") of this RabbitMQ" \
      "(a node of another version left running by an interrupted test? .ci/run reaps them;" \
      "by hand: RD_CLUSTER_CHROOT=<its chroot> scripts/cluster.sh clean)" >&2
    return 1
  fi
  write_config "$i"
  d=$(node_dir "$i")
  # RABBITMQ_* variables win over any rabbitmq-env.conf; both are set so the node is ours even
  # if one mechanism changes between RabbitMQ versions.
  as_rabbit env \
    RABBITMQ_CONF_ENV_FILE="$d/rabbitmq-env.conf" \
    RABBITMQ_NODENAME="$(node_name "$i")" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$(amqp_port "$i")" \
    RABBITMQ_DIST_PORT="$(dist_port "$i")" \
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
    RABBITMQ_MNESIA_BASE="$d/mnesia" \
    RABBITMQ_LOG_BASE="$d/log" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$d/enabled_plugins" \
    "$RMQ_BIN/rabbitmq-server" -detached >>"$d/log/startup.log" 2>&1
}

await_node() { # waits until node I's app runs
  local i=$1
  for _ in $(seq 1 120); do
    if ctl "$i" -q await_startup --timeout 5 >/dev/null 2>&1; then
      return 0
    fi
    sleep 1
  done
  echo "node $(node_name "$i") did not start; see $(node_dir "$i")/log" >&2
  return 1
}

joined_marker() { echo "$DIR/joined"; }

cmd_start() {
  for i in $(seq 1 "$NODES"); do start_node "$i"; done
  for i in $(seq 1 "$NODES"); do await_node "$i"; done
  if [ "$NODES" -gt 1 ] && [ ! -f "$(joined_marker)" ]; then
    for i in $(seq 2 "$NODES"); do
      # The CLI prints boot warnings of the joining node; keep them in its log directory.
      {
        ctl "$i" -q stop_app
        ctl "$i" -q reset
        ctl "$i" -q join_cluster "$(node_name 1)"
        ctl "$i" -q start_app
      } >>"$(node_dir "$i")/log/join.log" 2>&1 || {
        echo "joining $(node_name "$i") to $(node_name 1) failed; see $(node_dir "$i")/log/join.log" >&2
        exit 1
      }
    done
    touch "$(joined_marker)"
  fi
  for i in $(seq 1 "$NODES"); do await_node "$i"; done
  echo "started $NODES node(s): $(cmd_urls)"
}

cmd_stop() {
  # Highest first, node 1 last: a clustered node restarted later waits for the last one that
  # stopped, and `start` brings them all up together anyway.
  for i in $(seq "$NODES" -1 1); do
    if is_up "$i"; then
      ctl "$i" -q stop >/dev/null 2>&1 || true
    fi
  done
}

cmd_status() {
  for i in $(seq 1 "$NODES"); do
    if is_up "$i"; then
      echo "$(node_name "$i") up: amqp $(amqp_port "$i"), management $(mgmt_port "$i"), dist $(dist_port "$i")"
    else
      echo "$(node_name "$i") down"
    fi
  done
  for i in $(seq 1 "$NODES"); do
    if is_up "$i"; then
      ctl "$i" -q cluster_status
      return 0
    fi
  done
  return 1
}

cmd_urls() {
  local out=""
  for i in $(seq 1 "$NODES"); do
    out="$out${out:+,}amqp://guest:guest@127.0.0.1:$(amqp_port "$i")/%2f"
  done
  echo "$out"
}

node_arg() {
  if ! [[ ${1:-} =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ] || [ "$1" -gt "$NODES" ]; then
    echo "expected a node number between 1 and $NODES" >&2
    exit 2
  fi
}

case "${1:-}" in
start) cmd_start ;;
stop) cmd_stop ;;
clean)
  cmd_stop
  case "$DIR" in
  /tmp/?*) rm -rf "$DIR" ;;
  *) echo "not deleting $DIR (only directories under /tmp are removed)" >&2 ;;
  esac
  ;;
status) cmd_status ;;
urls) cmd_urls ;;
stop-node)
  node_arg "${2:-}"
  ctl "$2" -q stop
  ;;
ctl)
  node_arg "${2:-}"
  i=$2
  shift 2
  ctl "$i" "$@"
  ;;
start-node)
  node_arg "${2:-}"
  start_node "$2"
  await_node "$2"
  ;;
*)
  sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
  ;;
esac
