#!/usr/bin/env bash
# Make sure the local RabbitMQ node answers and its management API (port 15672) is up.
# Used by .ci/run and usable by hand before `cargo test`.
set -euo pipefail

wait_for() { # $1 = description, rest = command; up to 90 s
  local what=$1; shift
  for _ in $(seq 1 90); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "timed out waiting for $what" >&2
  return 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# scripts/tls.sh adds an amqps listener to the config; a node started before that must restart
# to open it (and to load the EXTERNAL mechanism's plugin).
if grep -q '^listeners.ssl' /etc/rabbitmq/rabbitmq.conf 2>/dev/null && ! port_open 5671 &&
  rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
  echo "restarting RabbitMQ to open its TLS listener (5671)"
  rabbitmqctl -q stop >/dev/null 2>&1 || true
  for _ in $(seq 1 30); do
    rabbitmq-diagnostics -q ping >/dev/null 2>&1 || break
    sleep 1
  done
fi

if ! rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
  echo "RabbitMQ is not answering: starting it with rabbitmq-server -detached"
  rabbitmq-server -detached || true
  wait_for "rabbitmq-diagnostics ping" rabbitmq-diagnostics -q ping
fi
# A node whose app was stopped (a fault test interrupted mid-way) answers ping but serves nothing.
rabbitmqctl -q start_app >/dev/null 2>&1 || true
wait_for "the RabbitMQ app" rabbitmq-diagnostics -q check_running

rabbitmq-plugins -q enable rabbitmq_management >/dev/null
wait_for "the management API on 127.0.0.1:15672" \
  curl -fsS -u guest:guest http://127.0.0.1:15672/api/overview
if grep -q '^listeners.ssl' /etc/rabbitmq/rabbitmq.conf 2>/dev/null; then
  wait_for "the TLS listener on 127.0.0.1:5671" port_open 5671
  echo "RabbitMQ is up (AMQP 5672, amqps 5671, management 15672)"
else
  echo "RabbitMQ is up (AMQP 5672, management 15672)"
fi
