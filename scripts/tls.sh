#!/usr/bin/env bash
# Throwaway TLS material for the tests, and the system RabbitMQ's TLS listener.
#
# usage: scripts/tls.sh [ensure | dir]
#   ensure (default)  make the certificates (once), then configure the system broker
#                     (/etc/rabbitmq/rabbitmq.conf) to listen for amqps on 127.0.0.1:5671 with
#                     them and to accept SASL EXTERNAL; scripts/ensure-rabbitmq.sh restarts the
#                     broker when the listener is configured but not up. scripts/rabbitmq4.sh
#                     configures its nodes from the same directory (ports 6673, 6674).
#   dir               print the directory
#
# In $REDELIVER_TLS_DIR (default /var/lib/redeliver-tls), all PEM:
#   ca.pem                 the test CA (what a client trusts)
#   server.pem/.key        the brokers' certificate: CN and subjectAltName DNS:localhost only,
#                          so amqps://localhost verifies and amqps://127.0.0.1 does not
#   client.pem/.key        a client certificate from the same CA, CN=guest (SASL EXTERNAL logs
#                          in as the user named by the CN)
#   other-ca.pem           an unrelated CA (a client that trusts only it must refuse the broker)
#   other-client.pem/.key  a client certificate from the unrelated CA (the broker refuses it)
# Nothing here is secret: the keys exist only for tests on this machine.
set -euo pipefail

DIR=${REDELIVER_TLS_DIR:-/var/lib/redeliver-tls}
SYSTEM_CONF=${RABBITMQ_SYSTEM_CONF:-/etc/rabbitmq/rabbitmq.conf}
SYSTEM_TLS=/etc/rabbitmq/tls
MARK="# redeliver tests: amqps (scripts/tls.sh)"

log() { echo "tls: $*" >&2; }

make_ca() { # name subject
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "$2" \
    -keyout "$DIR/$1.key" -out "$DIR/$1.pem" 2>/dev/null
}

make_cert() { # name ca subject extfile-contents
  local name=$1 ca=$2 subject=$3 ext=$4
  openssl req -newkey rsa:2048 -nodes -subj "$subject" \
    -keyout "$DIR/$name.key" -out "$DIR/$name.csr" 2>/dev/null
  printf '%s\n' "$ext" >"$DIR/$name.ext"
  openssl x509 -req -in "$DIR/$name.csr" -CA "$DIR/$ca.pem" -CAkey "$DIR/$ca.key" \
    -CAcreateserial -days 3650 -extfile "$DIR/$name.ext" -out "$DIR/$name.pem" 2>/dev/null
  rm -f "$DIR/$name.csr" "$DIR/$name.ext"
}

generate() {
  if [ -f "$DIR/other-client.pem" ]; then return 0; fi
  command -v openssl >/dev/null || {
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
  }
  local tmp="$DIR.partial"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  local final=$DIR
  DIR=$tmp
  make_ca ca "/CN=redeliver test CA"
  make_cert server ca "/CN=localhost" "subjectAltName=DNS:localhost
extendedKeyUsage=serverAuth
basicConstraints=CA:FALSE"
  make_cert client ca "/CN=guest" "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"
  make_ca other-ca "/CN=some other CA"
  make_cert other-client other-ca "/CN=guest" "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"
  # The brokers run as the rabbitmq user and read the server key.
  chmod 644 "$DIR"/*.pem "$DIR"/*.key
  DIR=$final
  rm -rf "$DIR"
  mv "$tmp" "$DIR"
  log "certificates in $DIR"
}

configure_system() {
  [ -f "$SYSTEM_CONF" ] || return 0
  mkdir -p "$SYSTEM_TLS"
  cp "$DIR/ca.pem" "$DIR/server.pem" "$DIR/server.key" "$SYSTEM_TLS/"
  if id rabbitmq >/dev/null 2>&1; then chown -R rabbitmq: "$SYSTEM_TLS"; fi
  if ! grep -qF "$MARK" "$SYSTEM_CONF"; then
    cat >>"$SYSTEM_CONF" <<EOF
$MARK
listeners.ssl.default = 127.0.0.1:5671
ssl_options.cacertfile = $SYSTEM_TLS/ca.pem
ssl_options.certfile = $SYSTEM_TLS/server.pem
ssl_options.keyfile = $SYSTEM_TLS/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
EOF
    log "amqps on 127.0.0.1:5671 configured in $SYSTEM_CONF"
  fi
  local plugins=/etc/rabbitmq/enabled_plugins
  if ! grep -q rabbitmq_auth_mechanism_ssl "$plugins" 2>/dev/null; then
    echo '[rabbitmq_management,rabbitmq_auth_mechanism_ssl].' >"$plugins"
  fi
}

case ${1:-ensure} in
  ensure)
    mkdir -p "$(dirname "$DIR")"
    generate
    configure_system
    ;;
  dir) echo "$DIR" ;;
  *)
    echo "usage: $0 [ensure | dir]" >&2
    exit 2
    ;;
esac
