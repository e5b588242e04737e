#!/usr/bin/env bash
# One call on the GPU machine for the prefill attention: the study binary (built here and carried in .ab/,
# see scripts/attn_prefill_study.cu) in three head shapes, and .ab/prefill_study_old (the same study built from
# an earlier commit, where present) beside it; then scripts/gpu_run.sh (build, `pytest -m cuda`, bench with
# BENCH_ARGS); then, unless SKIP_AB=1, the generate tests and the prefill bench again with
# QWEN_RT_PREFILL_ATTN=$AB_ATTN (default mma: the tile kernel the default build does not take on sm_90).
#   STUDY_CASES="1x8192 ..." QWEN_RT_COMMIT=<sha> BENCH_ARGS="--parts prefill" scripts/gpu_prefill_ab.sh [pytest args]
set -uo pipefail
OUT=${OUT:-/tmp/qwen_rt_out}
mkdir -p "$OUT"
study() {  # study BINARY LOG
  local bin=$1 log=$2
  [ -x "$bin" ] || return 0
  { timeout 150 "$bin" ${STUDY_CASES:-}
    timeout 60 "$bin" --heads 28 4 128 3x517+93 1x4096
    timeout 60 "$bin" --heads 16 2 64 3x517+93 1x4096; } > "$OUT/$log" 2>&1
  cat "$OUT/$log"
}
study .ab/prefill_study study.log
study .ab/prefill_study_old study_old.log
scripts/gpu_run.sh "$@"
[ "${SKIP_AB:-0}" = "1" ] && exit 0
QWEN_RT_PREFILL_ATTN=${AB_ATTN:-mma} timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider \
  tests/test_cuda_generate.py 2>&1 | tee "$OUT/pytest_generate_ab.log" | tail -5
if [ -n "${BENCH_ARGS:-}" ]; then
  QWEN_RT_PREFILL_ATTN=${AB_ATTN:-mma} timeout 200 python3 -m qwen_rt.bench gpu --parts prefill \
    --json "$OUT/bench_ab.jsonl" 2>&1 | tee "$OUT/bench_ab.log" | tail -15
fi
