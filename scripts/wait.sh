# shellcheck shell=bash
# Sourced by the scripts that wait for a service: `wait_for DESCRIPTION COMMAND...` runs
# COMMAND (quietly) once a second until it succeeds, for up to 90 s, then says what it waited
# for on stderr and returns 1.
wait_for() {
  local what=$1; shift
  for _ in $(seq 1 90); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "timed out waiting for $what" >&2
  return 1
}
