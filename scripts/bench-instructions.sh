#!/usr/bin/env bash
# Instructions per message of every consumer of the bench's happy-path scenario (raw, rawb,
# redeliver; quorum and classic), counted by valgrind's callgrind. Unlike a timed run, the
# count does not move with the host's load, so two builds can be compared on a busy machine.
#
#   cargo build --release -p redeliver-bench
#   bash scripts/bench-instructions.sh [OUT_DIR]     # about 5 minutes; AMQP_URL etc. as for the bench
#
# The bench runs twice, with --short and at full size, one round per side, every consumer
# child under callgrind (REDELIVER_BENCH_CHILD_WRAPPER). A child's count covers its whole life
# (start-up, connection, the drain, the paced phase); the difference between the two sizes,
# divided by the difference in messages, is the cost of one message without the start-up.
# OUT_DIR keeps the callgrind files (callgrind_annotate reads them, function by function).
set -euo pipefail

bin=${BENCH_BIN:-target/release/redeliver-bench}
out=${1:-$(mktemp -d /tmp/bench-instructions.XXXX)}
command -v valgrind > /dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
[ -x "$bin" ] || { echo "$bin not found: cargo build --release -p redeliver-bench" >&2; exit 1; }

# Messages each happy-path child handles: the backlog plus the paced phase (crates/bench/src/config.rs).
short_msgs=$((5000 + 300))
full_msgs=$((100000 + 10000))

for size in short full; do
    mkdir -p "$out/$size"
    flag=()
    [ "$size" = short ] && flag=(--short)
    echo "bench-instructions: $size run under callgrind -> $out/$size" >&2
    REDELIVER_BENCH_CHILD_WRAPPER="valgrind --tool=callgrind --callgrind-out-file=$out/$size/%p.callgrind" \
        "$bin" --only happy --rounds 1 "${flag[@]}" > "$out/$size/report.md" 2> "$out/$size/log" \
        || { echo "the $size run failed: $out/$size/log" >&2; exit 1; }
done

# One line per child: side, queue type, total instructions.
totals() {
    for f in "$1"/*.callgrind; do
        cmd=$(grep -m1 '^cmd:' "$f")
        side=$(sed -n 's/.*--side \([a-z-]*\).*/\1/p' <<< "$cmd")
        queue=$(sed -n 's/.*--queue-type \([a-z]*\).*/\1/p' <<< "$cmd")
        echo "$side $queue $(sed -n 's/^summary: //p' "$f")"
    done
}

totals "$out/short" > "$out/short.totals"
totals "$out/full" > "$out/full.totals"
echo
echo "| side | queue | instructions per message |"
echo "|---|---|---:|"
join -j1 <(awk '{print $1"/"$2, $3}' "$out/short.totals" | sort) \
    <(awk '{print $1"/"$2, $3}' "$out/full.totals" | sort) |
    awk -v s="$short_msgs" -v f="$full_msgs" '{
        split($1, k, "/");
        printf "| %s | %s | %d |\n", k[1], k[2], ($3 - $2) / (f - s)
    }'
