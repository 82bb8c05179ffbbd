#!/usr/bin/env bash
# CMake's compile launcher for libattnforge_cuda.so: runs the nvcc command, keeps its stderr (ptxas -v: registers,
# stack, spills per kernel and target) in LOG for scripts/cuda-compile-check.sh, so the check needs no second
# compile. The console sees the stderr only when the compile fails.
# Usage: capture-ptxas.sh LOG COMMAND...
set -u
log=$1
shift
"$@" 2>"$log.tmp"
status=$?
if [ $status -ne 0 ]; then cat "$log.tmp" >&2; fi
mv -f "$log.tmp" "$log"
exit $status
