#!/usr/bin/env bash
# The GPU switches (cpp/README.md) against the defaults in one or two device calls: build, `pytest -m cuda` (the
# tests run both forms of each switch), then the chunked delta rule against the token loop (QWEN_RT_DELTA_RULE=loop),
# the tile kernel against wgmma at head_dim 256 (QWEN_RT_PREFILL_ATTN=mma), the decode kernel against the rows kernel
# (QWEN_RT_DECODE_ATTN=rows), one piece in flight in the 1-row FP8 GEMV (QWEN_RT_FP8_GEMV_INFLIGHT=1), 16-bit GEMV
# rows; issue 32's long contexts. Carry build/cutlass (CUTLASS's include folder, from pip's nvidia-cutlass:
# cutlass_library/source/include) for the W8A8 GEMM.
# Everything under $OUT is packed into all.tgz (the device tool brings back 8 files at most).
#   tools/gpu_switches.sh build tests prefill          (one call, ~9 min)
#   tools/gpu_switches.sh prefill_mma decode longctx profile     (a second, on the warm machine)
#   tools/gpu_switches.sh concurrency                              (bf16 decode by batch, GEMV rows)
#   tools/gpu_switches.sh old fp8_ab    (git archive 2afd69a | gzip > .ab/old.tgz, carried: FP8 decode against it)
#   tools/gpu_switches.sh longctx_big; longctx_host; longctx_real prefill64k; longctx_move   (issue 32: four calls)
#   tools/gpu_switches.sh profile_batch                            (bf16 decode's kernels at batch 1 / 2 / 4)
set -uo pipefail
OUT=${OUT:-/tmp/qwen_rt_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 QWEN_RT_PROGRESS=0
export QWEN_RT_COMMIT=${QWEN_RT_COMMIT:-unknown} CUTLASS_DIR=$PWD/build/cutlass
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
bench() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  timeout "$t" "$@" --json "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
  echo "== $name rc $? $(el)"; grep -v "^{" "$OUT/$name.log" | grep -v "^measured" | tail -9
}
# The device brings back 8 files at most: one archive of everything, also when the call is stopped.
pack() { (cd "$OUT" && tar czf all.tgz --remove-files $(ls | grep -v '^all.tgz$')); }
trap pack EXIT
for part in "$@"; do case $part in
build)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  QWEN_RT_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a -C build-dir=build/gpu . > "$OUT/build.log" 2>&1 \
    || { grep -E "error" "$OUT/build.log" | head -30; tail -20 "$OUT/build.log"; exit 1; }
  grep -i "cutlass" "$OUT/build.log" | head -2; echo "build $(el)";;
tests)
  timeout ${TEST_TIMEOUT:-180} python3 -m pytest -m "cuda and not alone" -n 4 -q -p no:cacheprovider ${TESTS:-tests} \
    > "$OUT/pytest_cuda.log" 2>&1
  tail -3 "$OUT/pytest_cuda.log"; grep -E "^FAILED|^ERROR" "$OUT/pytest_cuda.log" | head -30
  timeout 60 python3 -m pytest -m "cuda and alone" -q -p no:cacheprovider tests > "$OUT/pytest_alone.log" 2>&1
  tail -2 "$OUT/pytest_alone.log"; echo "tests $(el)";;
decode)
  D="python3 -m qwen_rt.bench gpu --models qwen3.8-27b --parts decode --decode-batches 1,2,4,8 --quantization fp8"
  bench decode_fp8 90 $D
  bench decode_fp8_rows 90 env QWEN_RT_DECODE_ATTN=rows $D
  bench decode_fp8_inflight1 90 env QWEN_RT_FP8_GEMV_INFLIGHT=1 $D;;
longctx)
  L="python3 -m qwen_rt.bench gpu --parts longctx --longctx-lengths 32768 --longctx-budgets= --longctx-kv auto,fp8"
  L="$L --longctx-synthetic-from 32768 --quantization fp8 --new-tokens 16"
  bench longctx 90 $L
  bench longctx_rows 90 env QWEN_RT_DECODE_ATTN=rows $L;;
prefill)
  P="python3 -m qwen_rt.bench gpu --parts prefill --prefill-model qwen3.8-27b --prefill-lengths 8192"
  bench prefill 75 $P
  bench prefill_loop 75 env QWEN_RT_DELTA_RULE=loop $P;;
prefill_mma)
  P="python3 -m qwen_rt.bench gpu --parts prefill --prefill-model qwen3.8-27b --prefill-lengths 8192"
  bench prefill_mma 75 env QWEN_RT_PREFILL_ATTN=mma $P;;
concurrency)  # bf16 decode by batch: the 16-bit GEMV up to 8 rows at K > 3072 (QWEN_RT_GEMV_ROWS=8) against cuBLASLt
  C="python3 -m qwen_rt.bench gpu --models qwen3.8-27b --parts decode --decode-batches 1,2,4,8"
  bench decode_bf16 100 $C
  bench decode_bf16_gemv8 100 env QWEN_RT_GEMV_ROWS=8 $C
  bench decode_bf16_gemv4 100 env QWEN_RT_GEMV_ROWS=4 $C;;
old)  # the commit packed in .ab/old.tgz (git archive; carry it) built into /tmp/oldpkg: PYTHONPATH=/tmp/oldpkg runs it
  mkdir -p /tmp/oldsrc && tar xzf .ab/old.tgz -C /tmp/oldsrc
  (cd /tmp/oldsrc && QWEN_RT_CUDA=ON python3 -m pip install --no-build-isolation --no-deps --target /tmp/oldpkg \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a -C build-dir=/tmp/oldbuild . > "$OUT/build_old.log" 2>&1) \
    || grep -E "error" "$OUT/build_old.log" | head -20
  echo "old build $(el)";;
fp8_ab)  # FP8 27B batch-1 decode, this commit against the old one (part old), alternating; per-kernel profiles
  D="python3 -m qwen_rt.bench gpu --models qwen3.8-27b --parts decode --decode-batches 1 --quantization fp8"
  for i in 1 2; do
    bench fp8_new_$i 70 $D; bench fp8_old_$i 70 env PYTHONPATH=/tmp/oldpkg $D
    bench fp8_inflight1_$i 70 env QWEN_RT_FP8_GEMV_INFLIGHT=1 $D
  done
  for v in new old; do
    [ $v = old ] && pp=/tmp/oldpkg || pp=
    PYTHONPATH=$pp QWEN_RT_PDL=0 timeout 90 python3 tools/profile_decode.py --model qwen3.8-27b --quantization fp8 \
      --batch 1 --tokens 16 --out "$OUT/fp8_profile_$v.txt" > "$OUT/fp8_profile_$v.log" 2>&1
    echo "profile $v rc $? $(el)"; head -12 "$OUT/fp8_profile_$v.txt"
  done;;
longctx_big)  # issue 32's table, Qwen3.8-27B FP8 weights, fp8 KV, on the device: 4k real, 128k-1M stand-in contexts
  # (~9 min: a 27B Generator takes ~20 s to start, and there are 14)
  L="python3 -m qwen_rt.bench gpu --parts longctx --quantization fp8 --new-tokens 16 --longctx-kv fp8"
  L="$L --longctx-budgets 2048,4096 --longctx-synthetic-from 131072"
  bench longctx_device_a 200 $L --longctx-lengths 4096,131072
  bench longctx_device_b 240 $L --longctx-lengths 262144,1048576
  bench longctx_device_agg 90 env QWEN_RT_SELECT_AGG=1 $L --longctx-lengths 1048576 --longctx-budgets 2048;;
longctx_host)  # 128k and 1M stand-in contexts through a 6 GiB device pool and the host tier: full attention, and
  # sparse with 512 staging frames and without (~9 min)
  L="python3 -m qwen_rt.bench gpu --parts longctx --quantization fp8 --new-tokens 16 --longctx-kv fp8"
  L="$L --longctx-budgets 2048,4096 --longctx-staging 512,0 --longctx-synthetic-from 131072 --longctx-offload -1"
  L="$L --longctx-kv-memory $((6 << 30))"
  bench longctx_host_128k 200 $L --longctx-lengths 131072
  bench longctx_host_1m 330 $L --longctx-lengths 1048576;;
longctx_real)  # a real 256k-token prefill on the device, then full and sparse decode (~5 min)
  L="python3 -m qwen_rt.bench gpu --parts longctx --quantization fp8 --new-tokens 16 --longctx-kv fp8"
  bench longctx_256k 300 $L --longctx-synthetic-from 0 --longctx-lengths 262144 --longctx-budgets 2048;;
longctx_move)  # a real 128k-token prefill through a 3 GiB device pool and the host tier, the page moves on the
  # step's stream and on their own (QWEN_RT_MOVE_STREAM=1) (~6 min)
  L="python3 -m qwen_rt.bench gpu --parts longctx --quantization fp8 --new-tokens 16 --longctx-kv fp8"
  L="$L --longctx-synthetic-from 0 --longctx-lengths 131072 --longctx-budgets 2048 --longctx-offload -1"
  L="$L --longctx-kv-memory $((3 << 30))"
  bench move_128k 180 $L
  bench move_128k_stream 180 env QWEN_RT_MOVE_STREAM=1 $L;;
prefill64k)
  bench prefill_64k 150 python3 -m qwen_rt.bench gpu --parts prefill --prefill-model qwen3.8-27b \
    --prefill-lengths 65536;;
profile_batch)  # where bf16 decode's time goes at batches 1, 2, 4 (issue 30: batch 2 steps 0.86 ms longer; roofline 0.1)
  for b in 1 2 4; do
    QWEN_RT_PDL=0 timeout 100 python3 tools/profile_decode.py --model qwen3.8-27b --batch $b --tokens 16 \
      --out "$OUT/bf16_profile_b$b.txt" > "$OUT/bf16_profile_b$b.log" 2>&1
    echo "profile b$b rc $? $(el)"; head -14 "$OUT/bf16_profile_b$b.txt"
  done;;
profile)
  timeout 100 python3 -m qwen_rt.bench gpu --parts gemm --gemm-rows 1024,8192 --json "$OUT/gemm.jsonl" 2>&1 \
    | grep -v "^{" > "$OUT/gemm.log"; tail -14 "$OUT/gemm.log"; echo "gemm $(el)"
  QWEN_RT_PDL=0 timeout 150 python3 tools/profile_decode.py --model qwen3.8-27b --prompt-len 8192 --tokens 0 \
    --out "$OUT/prefill8k_profile.txt" > "$OUT/prefill8k_profile.log" 2>&1; echo "profile rc $? $(el)"
  head -30 "$OUT/prefill8k_profile.txt";;
esac; done
