#!/usr/bin/env bash
# Runs every fuzz_* binary in $1 from its seed corpus; exits non-zero on any finding (an input that runs over 30 s,
# a hang, is one).
#   run_fuzzers.sh BIN_DIR [SECONDS]       each harness for SECONDS (default 60), FUZZ_JOBS (default: the cores)
#                                          harnesses at a time: `make fuzz`, CI
#   FUZZ_RUNS=N [FUZZ_WORKERS=W] [FUZZ_ONLY=REGEX] run_fuzzers.sh BIN_DIR
#                                          each harness (those whose name matches REGEX) to N executions in all,
#                                          split over W processes with distinct seeds sharing one corpus:
#                                          `make fuzz-long` (60 s is 10^6-10^7 executions and missed issue 15)
set -euo pipefail
bin_dir=$1
seconds=${2:-60}
runs=${FUZZ_RUNS:-}
workers=${FUZZ_WORKERS:-1}
only=${FUZZ_ONLY:-.}
here=$(cd "$(dirname "$0")" && pwd)
jobs=${FUZZ_JOBS:-$(nproc)}
[ -n "$runs" ] && jobs=1   # FUZZ_RUNS already spreads one harness over FUZZ_WORKERS processes

fuzz_one() {   # one harness, its report on stdout; non-zero on a finding
  local fuzzer=$1 name seeds regressions work artifacts started failed elapsed executions
  name=$(basename "$fuzzer")
  seeds="$here/corpus/${name#fuzz_}"
  regressions=()   # past findings, replayed first (libFuzzer runs every corpus input before mutating it)
  [ -d "$here/regressions/${name#fuzz_}" ] && regressions=("$here/regressions/${name#fuzz_}")
  work=$(mktemp -d)
  artifacts=$(mktemp -d)
  started=$(date +%s)
  failed=0
  if [ -z "$runs" ]; then
    echo "fuzz: $name for ${seconds}s (seeds: $seeds)"
    "$fuzzer" -max_total_time="$seconds" -timeout=30 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "$work" "$seeds" "${regressions[@]}" > "$work.log" 2>&1 || failed=1
  else
    echo "fuzz: $name to $runs executions in $workers process(es) (seeds: $seeds)"
    : > "$work.log"
    pids=()
    for w in $(seq 1 "$workers"); do
      "$fuzzer" -runs=$(( (runs + workers - 1) / workers )) -seed="$w" -timeout=30 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "$work" "$seeds" "${regressions[@]}" > "$work.$w.log" 2>&1 &
      pids+=($!)
    done
    for w in $(seq 1 "$workers"); do
      wait "${pids[$((w - 1))]}" || failed=1
      cat "$work.$w.log" >> "$work.log"
      rm -f "$work.$w.log"
    done
  fi
  if [ "$failed" -ne 0 ]; then
    echo "fuzz: $name FOUND A PROBLEM; reproducer(s) in $artifacts:"; ls "$artifacts"
    tail -40 "$work.log"
  fi
  elapsed=$(( $(date +%s) - started ))
  grep -E 'stat::number_of_executed_units|stat::new_units_added' "$work.log" | sed "s/^/fuzz: $name /"
  executions=$(awk '/stat::number_of_executed_units/ {n += $2} END {print n + 0}' "$work.log")
  echo "fuzz: $name: $executions executions in ${elapsed}s, $([ "$failed" -eq 0 ] && echo 'no finding' || echo 'FINDING')"
  rm -rf "$work" "$work.log"
  return $failed
}

status=0
reports=$(mktemp -d)
pids=() names=()
for fuzzer in "$bin_dir"/fuzz_*; do
  [ -x "$fuzzer" ] || continue
  name=$(basename "$fuzzer")
  [[ $name =~ $only ]] || continue
  if [ "${#pids[@]}" -ge "$jobs" ]; then   # a slot frees when the oldest harness of the batch ends
    wait "${pids[0]}" || status=1
    cat "$reports/${names[0]}"
    pids=("${pids[@]:1}") names=("${names[@]:1}")
  fi
  fuzz_one "$fuzzer" > "$reports/$name" 2>&1 &
  pids+=($!) names+=("$name")
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  cat "$reports/${names[$i]}"
done
rm -rf "$reports"
exit $status
