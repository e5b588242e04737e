#!/usr/bin/env bash
# Checks the CUDA wheel as a user gets it, on a GPU machine with no internet: builds the wheel with nvcc (or takes
# WHEEL=path), installs it into a fresh venv with nvcc off the PATH and no CUDA toolkit in the environment, and
# runs `pytest -m cuda` there. The venv sees python3's own packages (torch, transformers, pytest, and pip's
# nvidia-cublas / nvidia-nccl-cu13 that torch brought) through a .pth file, so the install needs no index; the
# plugin then finds cuBLASLt and NCCL where Python finds those packages (qwen_rt/_native_libraries.py).
# Logs under $OUT.
#   tools/gpu_wheel_check.sh [pytest args...]       env: WHEEL=<a built wheel>, TEST_WORKERS (default 4),
#     BENCH_ARGS="--parts ..." (then `qwen-rt bench gpu` runs from the wheel's venv; record in $OUT/bench.jsonl)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/qwen_rt_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 QWEN_RT_PROGRESS=0
PY=${PYTHON:-python3}
fail() { echo "gpu_wheel_check: $*"; exit 1; }

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
if [ -z "${WHEEL:-}" ]; then
  command -v nvcc >/dev/null || fail "no nvcc to build the wheel with (or pass WHEEL=<path>)"
  t0=$(date +%s)
  rm -rf "$OUT/wheel"
  (cd "$ROOT" && CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) QWEN_RT_CUDA=ON "$PY" -m pip wheel --no-build-isolation \
     --no-deps -w "$OUT/wheel" -C build-dir=build/wheel .) > "$OUT/wheel_build.log" 2>&1 \
    || { tail -40 "$OUT/wheel_build.log"; fail "the wheel did not build"; }
  echo "wheel build: $(( $(date +%s) - t0 )) s"
  WHEEL=$(ls "$OUT"/wheel/qwen_rt-*.whl | head -1)
fi
echo "wheel: $WHEEL"

# What the plugin asks of the machine: its libraries by soname and where it looks for them.
PEEK=$(mktemp -d)
"$PY" -m zipfile -e "$WHEEL" "$PEEK" || fail "cannot unpack $WHEEL"
[ -f "$PEEK/qwen_rt/_cuda_backend.so" ] || fail "the wheel has no CUDA plugin (qwen_rt/_cuda_backend.so)"
readelf -d "$PEEK/qwen_rt/_cuda_backend.so" | grep -E "NEEDED|RUNPATH|RPATH" | tee "$OUT/plugin_needs.txt"
cuobjdump --list-elf "$PEEK/qwen_rt/_cuda_backend.so" 2>/dev/null | grep -o "sm_[0-9a-z]*" | sort | uniq -c
cuobjdump --list-ptx "$PEEK/qwen_rt/_cuda_backend.so" 2>/dev/null | grep -o "sm_[0-9a-z]*" | sort | uniq -c | sed 's/$/ (PTX)/'

# A fresh venv over python3's packages.
VENV=$(mktemp -d)/venv
"$PY" -m venv "$VENV" || fail "cannot make a venv"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" -c "import site; print('\n'.join(site.getsitepackages()))" > "$SITE/parent_site_packages.pth"

# nvcc and the CUDA toolkit out of sight: PATH without any folder holding nvcc, no CUDA variables.
CLEAN_PATH=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -n "$d" ] && [ ! -x "$d/nvcc" ] && echo "$d"; done | paste -sd:)
cd "$ROOT"
env -u LD_LIBRARY_PATH -u CUDA_HOME -u CUDA_PATH -u CUDACXX PATH="$VENV/bin:$CLEAN_PATH" bash -c '
  set -uo pipefail
  command -v nvcc && { echo "gpu_wheel_check: nvcc is still on the PATH"; exit 1; }
  python -m pip install -q --no-index --no-cache-dir "'"$WHEEL"'" || { echo "gpu_wheel_check: pip install failed"; exit 1; }
  python -m pip check | grep -i qwen
  python -c "import qwen_rt, sys; f = qwen_rt.__file__; print(\"qwen_rt from\", f); sys.exit(not f.startswith(\"'"$VENV"'\"))" \
    || { echo "gpu_wheel_check: qwen_rt is not the venv'"'"'s"; exit 1; }
  (cd /tmp && qwen-rt info)
  python -c "import qwen_rt._core as c, sys; n = c.cuda_device_count(); print(\"cuda devices:\", n, c.cuda_unavailable_reason()); sys.exit(n == 0)" \
    || { echo "gpu_wheel_check: the wheel sees no GPU"; exit 1; }
  t0=$(date +%s)
  { timeout ${TEST_TIMEOUT:-400} python -m pytest -m "cuda and not alone" -n ${TEST_WORKERS:-4} -q -p no:cacheprovider "$@"
    timeout 120 python -m pytest -m "cuda and alone" -q -p no:cacheprovider "$@"; } 2>&1 | tee "'"$OUT"'/pytest_wheel.log" | tail -30
  echo "tests: $(( $(date +%s) - t0 )) s"
  if [ -n "${BENCH_ARGS:-}" ]; then
    t0=$(date +%s)
    timeout ${BENCH_TIMEOUT:-400} python -m qwen_rt.bench gpu $BENCH_ARGS --json "'"$OUT"'/bench.jsonl" 2>&1 \
      | tee "'"$OUT"'/bench.log" | tail -60
    echo "bench: $(( $(date +%s) - t0 )) s"
  fi
' _ "$@"
