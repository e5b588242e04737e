#!/usr/bin/env bash
# A/B measurements after tools/gpu_run.sh has built and installed the package: the same bench part
# with a runtime switch off and on. Tables go to stdout and $OUT/ab.log.
#   tools/gpu_ab.sh "ENV=VALUE" "bench gpu args..."   (run with ENV set, then without; REPEATS=<n> pairs, default 1)
set -uo pipefail
OUT=${OUT:-/tmp/qwen_rt_out}
env_set=$1; shift
for i in $(seq "${REPEATS:-1}"); do
  for e in "$env_set" ""; do
    echo "== ${e:-default} : $*" | tee -a "$OUT/ab.log"
    env $e python3 -m qwen_rt.bench gpu "$@" 2>/dev/null | grep -v '^{' | tee -a "$OUT/ab.log"
  done
done
