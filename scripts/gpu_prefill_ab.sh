#!/usr/bin/env bash
# One call on the GPU machine for the prefill attention: the study binaries (built here, carried in .ab/:
# scripts/attn_prefill_study.cu, and the same with -DQRT_WGMMA_V_SWAP), then scripts/gpu_run.sh (build,
# `pytest -m cuda`, bench with BENCH_ARGS), then the prefill bench again with QWEN_RT_PREFILL_ATTN=$AB_ATTN
# (default wgmma: the kernel the default build does not take).
# If the wgmma kernel disagrees with the tile kernel and the swapped V descriptor agrees, the build takes the swap.
set -uo pipefail
OUT=${OUT:-/tmp/qwen_rt_out}
mkdir -p "$OUT"
agrees() {  # the default kernel's rows of a study log within 5% of the output's peak
  python3 - "$1" <<'PY'
import re, sys
rows = [l for l in open(sys.argv[1]) if "max diff" in l and "overlap 128x2 s3" in l]
bad = [l for l in rows if not (lambda m: m and float(m[1]) <= 0.05 * float(m[2]))(re.search(r"max diff (\S+) \(of (\S+)\)", l))]
print(f"{sys.argv[1]}: {len(rows)} rows, {len(bad)} disagree")
sys.exit(1 if bad or not rows else 0)
PY
}
timeout 150 .ab/prefill_study ${STUDY_CASES:-} > "$OUT/study.log" 2>&1; cat "$OUT/study.log"
timeout 60 .ab/prefill_study --heads 28 4 128 3x517+93 1x4096 > "$OUT/study_g7.log" 2>&1; cat "$OUT/study_g7.log"
timeout 60 .ab/prefill_study --heads 16 2 64 3x517+93 1x4096 > "$OUT/study_d64.log" 2>&1; cat "$OUT/study_d64.log"
if ! agrees "$OUT/study.log"; then
  timeout 60 .ab/prefill_study_swap 3x517+93 1x4096 > "$OUT/study_swap.log" 2>&1; cat "$OUT/study_swap.log"
  if agrees "$OUT/study_swap.log"; then
    echo "taking the swapped V descriptor"
    sed -i '1i #define QRT_WGMMA_V_SWAP 1' cpp/backend/cuda/attention_sm90.cuh
  else
    echo "neither V descriptor agrees: the wgmma kernel is off for this build"
    AB_ATTN=mma
  fi
fi
scripts/gpu_run.sh "$@"
QWEN_RT_PREFILL_ATTN=${AB_ATTN:-wgmma} timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider \
  tests/test_cuda_generate.py 2>&1 | tee "$OUT/pytest_generate_ab.log" | tail -5
if [ -n "${BENCH_ARGS:-}" ]; then
  QWEN_RT_PREFILL_ATTN=${AB_ATTN:-wgmma} timeout 200 python3 -m qwen_rt.bench gpu --parts prefill \
    --json "$OUT/bench_ab.jsonl" 2>&1 | tee "$OUT/bench_ab.log" | tail -15
fi
