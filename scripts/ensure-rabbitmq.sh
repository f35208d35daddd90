#!/usr/bin/env bash
# Make sure the machine's RabbitMQ node answers and its management API (port 15672) is up: for
# the bench and for work by hand. The tests need none of it (they bring up what they need
# themselves: crates/testkit/src/fixtures.rs).
set -euo pipefail

# wait_for DESCRIPTION COMMAND...: up to 90 s.
source "$(dirname "${BASH_SOURCE[0]}")/wait.sh"

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
echo "RabbitMQ is up (AMQP 5672, management 15672)"
