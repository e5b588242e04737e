#!/usr/bin/env bash
# One call on the GPU machine: build with ninja on every core, run `pytest -m cuda` (TEST_WORKERS=4 xdist
# processes), then the GPU bench.
# Logs and the bench record go under $OUT (the device tool brings them back).
#   tools/gpu_run.sh [pytest args...]            env: BENCH_ARGS="--parts decode ..." (empty: skip the bench)
set -uo pipefail
OUT=${OUT:-/tmp/qwen_rt_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 QWEN_RT_PROGRESS=0
# The device copy's git metadata lags the working tree (its HEAD named a commit sessions old): pass
# QWEN_RT_COMMIT=<commit> from here; without it the record says "unknown" rather than a wrong commit.
export QWEN_RT_COMMIT=${QWEN_RT_COMMIT:-unknown}
[ "$QWEN_RT_COMMIT" = unknown ] && echo "gpu_run.sh: QWEN_RT_COMMIT not given; the bench record's commit is 'unknown'"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
t0=$(date +%s)
QWEN_RT_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a -C build-dir=build/gpu . > "$OUT/build.log" 2>&1 \
  || { grep -E "error|Error" "$OUT/build.log" | head -40; tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
(cd /tmp && python3 -c "import qwen_rt._core as c; print('cuda devices:', c.cuda_device_count(), c.cuda_plugin_error())")
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  t0=$(date +%s)
  # TEST_WORKERS xdist processes share the GPU; the tests marked `alone` (whole-device memory) run after them.
  { timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m "cuda and not alone" -n ${TEST_WORKERS:-4} -q -p no:cacheprovider "$@"
    timeout 120 python3 -m pytest -m "cuda and alone" -q -p no:cacheprovider "$@"; } 2>&1 | tee "$OUT/pytest_cuda.log" | tail -40
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
if [ -n "${BENCH_ARGS:-}" ]; then
  t0=$(date +%s)
  timeout ${BENCH_TIMEOUT:-400} python3 -m qwen_rt.bench gpu $BENCH_ARGS --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log" | tail -60
  echo "bench: $(( $(date +%s) - t0 )) s"
fi
