#!/usr/bin/env bash
# Runs every fuzz_* binary in $1 for $2 seconds from its seed corpus; exits non-zero on any finding.
set -euo pipefail
bin_dir=$1
seconds=${2:-60}
here=$(cd "$(dirname "$0")" && pwd)
status=0
for fuzzer in "$bin_dir"/fuzz_*; do
  [ -x "$fuzzer" ] || continue
  name=$(basename "$fuzzer")
  seeds="$here/corpus/${name#fuzz_}"
  regressions=()   # past findings, replayed first (libFuzzer runs every corpus input before mutating it)
  [ -d "$here/regressions/${name#fuzz_}" ] && regressions=("$here/regressions/${name#fuzz_}")
  work=$(mktemp -d)
  artifacts=$(mktemp -d)
  echo "fuzz: $name for ${seconds}s (seeds: $seeds)"
  if ! "$fuzzer" -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix="$artifacts/" \
       "$work" "$seeds" "${regressions[@]}" > "$work.log" 2>&1; then
    echo "fuzz: $name FOUND A PROBLEM; reproducer(s) in $artifacts:"; ls "$artifacts"
    tail -40 "$work.log"
    status=1
  fi
  grep -E 'stat::number_of_executed_units|stat::new_units_added' "$work.log" | sed "s/^/fuzz: $name /"
  rm -rf "$work"
done
exit $status
