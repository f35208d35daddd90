#!/usr/bin/env bash
# Put this machine's RabbitMQ back into the state a new machine of this kind has it in, so that
# the README's test command runs as it would for a new user: the system node (3.10.8,
# 127.0.0.1:5672, guest/guest) running, with no management plugin, no TLS listener, and no test
# certificates anywhere. .ci/run calls it before the tests against that node; `check` only
# verifies the state and fails when it is not that of a new machine.
#
# usage: scripts/new-machine.sh [reset | check]
#
# What earlier runs may have left, and what this undoes:
#   - plugins enabled by the tests (rabbitmq_management) or by older versions of this project's
#     scripts (rabbitmq_auth_mechanism_ssl): disabled, online, no restart;
#   - an amqps listener that older versions of scripts/tls.sh appended to
#     /etc/rabbitmq/rabbitmq.conf: the block removed, and the node restarted to close it;
#   - test certificates: /var/lib/redeliver-tls (older scripts) and the testkit's
#     $TMPDIR/redeliver-test-tls.
# The dedicated nodes the tests start (rdtls, rdsolo, ...) are .ci/run's to reap.
set -euo pipefail

CONF=/etc/rabbitmq/rabbitmq.conf
MARK="# redeliver tests: amqps (scripts/tls.sh)"
TEST_TLS="${TMPDIR:-/tmp}/redeliver-test-tls"

log() { echo "new-machine: $*" >&2; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_for DESCRIPTION COMMAND...: up to 90 s.
source "$(dirname "${BASH_SOURCE[0]}")/wait.sh"

reset() {
  local restart=""
  if grep -qF "$MARK" "$CONF" 2>/dev/null; then
    # The block is the marker and the ten lines after it, appended at the end of the file.
    sed -i "/^$(printf '%s' "$MARK" | sed 's/[][\/.*^$]/\\&/g')\$/,+10d" "$CONF"
    log "removed the amqps listener from $CONF"
    restart=yes
  fi
  rm -rf /var/lib/redeliver-tls /etc/rabbitmq/tls "$TEST_TLS" "$TEST_TLS.partial"
  if [ -n "$restart" ] && rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
    log "restarting RabbitMQ to close its amqps listener"
    rabbitmqctl -q stop >/dev/null 2>&1 || true
    wait_for "RabbitMQ to stop" sh -c '! rabbitmq-diagnostics -q ping'
  fi
  # A new machine has the node running: start it if a fault test or the restart above left it
  # down (that is its state on a new machine, not a preparation the tests need).
  if ! rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
    log "starting RabbitMQ (rabbitmq-server -detached)"
    rabbitmq-server -detached >/dev/null 2>&1 || true
    wait_for "rabbitmq-diagnostics ping" rabbitmq-diagnostics -q ping
  fi
  rabbitmqctl -q start_app >/dev/null 2>&1 || true
  wait_for "the RabbitMQ app" rabbitmq-diagnostics -q check_running
  rabbitmq-plugins -q disable rabbitmq_management rabbitmq_auth_mechanism_ssl >/dev/null
  wait_for "the management API to close" sh -c '! (exec 3<>/dev/tcp/127.0.0.1/15672) 2>/dev/null'
  check
}

check() {
  local bad=""
  port_open 5672 || bad="$bad AMQP-5672-closed"
  port_open 15672 && bad="$bad management-plugin-on"
  port_open 5671 && bad="$bad amqps-listener-open"
  [ -e "$TEST_TLS" ] && bad="$bad $TEST_TLS"
  [ -e /var/lib/redeliver-tls ] && bad="$bad /var/lib/redeliver-tls"
  if [ -n "$bad" ]; then
    log "not the state of a new machine:$bad"
    return 1
  fi
  log "RabbitMQ as on a new machine: AMQP on 5672, no management API, no amqps, no test certificates"
}

case ${1:-reset} in
  reset) reset ;;
  check) check ;;
  *)
    echo "usage: $0 [reset | check]" >&2
    exit 2
    ;;
esac
