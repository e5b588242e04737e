#!/usr/bin/env bash
# A/B of source changes in one call on the GPU machine: the working tree ("base") against the working tree plus
# each patch, one build per variant (incremental), each variant's tests, then the GPU bench alternated over the
# variants. Tables go to stdout and $OUT/ab.log.
#   tools/gpu_ab_patch.sh "bench gpu args" PATCH...
#   env: TESTS='tests/x.py -k "a or b"' (pytest -m cuda args, shell-quoted, run on each patched build; empty:
#        none; TEST_WORKERS=<n>: in parallel), BASE_TESTS (the same on the base build), REPEATS=<rounds> (default 2), QWEN_RT_COMMIT=<base commit>
set -uo pipefail
OUT=${OUT:-/tmp/qwen_rt_out}
mkdir -p "$OUT"
bench_args=$1; shift
export NCCL_NVLS_ENABLE=0 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 QWEN_RT_PROGRESS=0
export QWEN_RT_COMMIT=${QWEN_RT_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
pkgs=/tmp/ab_pkgs
rm -rf "$pkgs" && mkdir -p "$pkgs"

build() {  # build and install the working tree, then keep a copy of the installed package as variant $1
  local t0=$(date +%s)
  QWEN_RT_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a -C build-dir=build/gpu . > "$OUT/build_$1.log" 2>&1 \
    || { grep -E "error" "$OUT/build_$1.log" | head -30; return 1; }
  local p=$(cd /tmp && python3 -c "import qwen_rt, os; print(os.path.dirname(qwen_rt.__file__))")
  mkdir -p "$pkgs/$1" && cp -r "$p" "$pkgs/$1/"
  echo "build $1: $(( $(date +%s) - t0 )) s"
}
run_tests() {  # variant, pytest args
  local name=$1; shift
  [ $# -eq 0 ] && return 0
  local t0=$(date +%s)
  # With TEST_WORKERS, xdist processes share the GPU and the tests marked `alone` run after them (as gpu_run.sh).
  if [ -n "${TEST_WORKERS:-}" ]; then
    { PYTHONPATH="$pkgs/$name" timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m "cuda and not alone" \
        -n "$TEST_WORKERS" -q -p no:cacheprovider "$@"
      PYTHONPATH="$pkgs/$name" timeout 120 python3 -m pytest -m "cuda and alone" -q -p no:cacheprovider "$@"; } \
      2>&1 | tee "$OUT/pytest_$name.log" | tail -12
  else
    PYTHONPATH="$pkgs/$name" timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m cuda -q -p no:cacheprovider "$@" \
      2>&1 | tee "$OUT/pytest_$name.log" | tail -8
  fi
  echo "tests $name: $(( $(date +%s) - t0 )) s"
}

variants=(base)
build base || exit 1
eval "run_tests base ${BASE_TESTS:-}"
for patch in "$@"; do
  name=$(basename "$patch" .patch)
  git apply "$patch" || { echo "patch $patch does not apply"; continue; }
  # The tests run while the patch is applied (they may be part of it), and only on a build that succeeded.
  if build "$name"; then
    variants+=("$name")
    eval "run_tests \"\$name\" ${TESTS:-}"
  fi
  git apply -R "$patch"
done
# Rounds alternate the order (A B, B A, ...) so that a drift over the call does not favour one variant.
for i in $(seq "${REPEATS:-2}"); do
  order=("${variants[@]}")
  if (( i % 2 == 0 )); then
    order=(); for (( j=${#variants[@]}-1; j>=0; j-- )); do order+=("${variants[j]}"); done
  fi
  for v in "${order[@]}"; do
    echo "== round $i, $v : $bench_args" | tee -a "$OUT/ab.log"
    PYTHONPATH="$pkgs/$v" timeout ${BENCH_TIMEOUT:-200} python3 -m qwen_rt.bench gpu $bench_args \
      2> "$OUT/bench_${v}_$i.err" | grep -v '^{' | tee -a "$OUT/ab.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "bench $v failed:"; tail -20 "$OUT/bench_${v}_$i.err"; }
  done
done
