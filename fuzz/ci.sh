#!/usr/bin/env bash
# The bounded fuzzing step of .ci/run: builds every target in fuzz/ with the stable toolchain
# and runs each for FUZZ_SECONDS (default 20) from the committed corpus (README.md says why
# without a sanitizer). New inputs go to a temporary directory, so the committed corpus does
# not change; a crash leaves its input in fuzz/artifacts/<target>/ and fails the step.
#
#   bash fuzz/ci.sh                      # as CI runs it
#   FUZZ_SECONDS=600 bash fuzz/ci.sh     # longer
set -euo pipefail
cd "$(dirname "$0")"
seconds=${FUZZ_SECONDS:-20}
started=$(date +%s)

# cargo-fuzz drives libFuzzer; a new machine has none (about 80 s to build).
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked --version 0.13.2 --quiet
  echo "== cargo-fuzz installed in $(($(date +%s) - started)) s"
fi

# Not a member of the workspace: the root's `cargo fmt --all` does not see it.
cargo fmt --check

# No sanitizer: the stable toolchain has none (-Zsanitizer is nightly-only), and redeliver's
# crates forbid unsafe code. Debug assertions on: an overflow is a crash, as in a debug build.
# 16 codegen units: a quicker build for a slightly slower fuzzer.
flags=(--sanitizer none --debug-assertions --codegen-units 16)
t0=$(date +%s)
cargo fuzz build "${flags[@]}"
echo "== fuzz targets built in $(($(date +%s) - t0)) s"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=()
for target in $(cargo fuzz list); do
  mkdir -p "$work/$target"
  log="$work/$target.log"
  # -timeout: an input taking 10 s is a finding too (a quadratic parser, a loop).
  if cargo fuzz run "${flags[@]}" "$target" "$work/$target" "corpus/$target" -- \
    -max_total_time="$seconds" -max_len=16384 -timeout=10 >"$log" 2>&1; then
    echo "== fuzz $target: $(grep -a '^Done' "$log" | tail -n 1)"
  else
    echo "== fuzz $target: FAILED"
    grep -a -A 12 -m 1 'panicked\|ERROR: libFuzzer' "$log" || tail -n 40 "$log"
    grep -a 'Test unit written to\|^Base64:' "$log" || true
    failed+=("$target")
  fi
done
echo "== fuzzing took $(($(date +%s) - started)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz targets failed: ${failed[*]} (reproduce: cd fuzz && cargo fuzz run --sanitizer none -a TARGET artifacts/TARGET/crash-...)" >&2
  exit 1
fi
