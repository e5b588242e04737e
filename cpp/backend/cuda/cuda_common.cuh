// Shared helpers of the CUDA backend: error checks, element conversions, launch declarations.
// Internal to cpp/backend/cuda/.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "backend/ops.h"
#include "core/error.h"

namespace qrt::cuda {

inline void check(cudaError_t e, const char* op) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error
    throw std::runtime_error(str_cat("cuda ", op, ": ", cudaGetErrorString(e)));
  }
}
// After a kernel launch.
inline void check_launch(const char* op) { check(cudaGetLastError(), op); }

inline unsigned ceil_div(int64_t a, int64_t b) { return unsigned((a + b - 1) / b); }
// Rows starting at p, stride_bytes apart, can be read in 16-byte pieces.
inline bool aligned16(const void* p, int64_t stride_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride_bytes % 16 == 0;
}

// 16 bytes of weights, read once: not kept in L1 (which holds the activations).
__device__ __forceinline__ uint4 load_weight(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 bytes global -> shared, asynchronously, cached in L2 only (valid false: zeros); a thread's copies land in
// groups: commit closes one, wait<N> waits until at most N of its groups are in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned sa = unsigned(__cvta_generic_to_shared(smem));
  const int sz = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(sz));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// c (16 x 8, fp32) += a (16 x 16) b (16 x 8), T = bf16 or f16, in mma.sync m16n8k16's fragment layout.
template <typename T>
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// lo and hi rounded to T, as one 32-bit word (lo in the low half): an mma operand pair.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 32-bit word i of a 16-byte piece.
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Two e4m3 (bits 0-15 of v) as a pair of T, exactly.
template <typename T> __device__ __forceinline__ uint32_t e4m3x2_to(uint32_t v);
template <> __device__ __forceinline__ uint32_t e4m3x2_to<__half>(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(v & 0xFFFFu), __NV_E4M3);
  return uint32_t(h.x) | uint32_t(h.y) << 16;
}
template <> __device__ __forceinline__ uint32_t e4m3x2_to<__nv_bfloat16>(uint32_t v) {
  // Byte b as the bf16 bits (sign << 8 | magnitude << 4) is b's value times 2^-120, normal and subnormal alike
  // (bf16's exponent bias is 120 above e4m3's); times 2^120 (bf16 0x7B80) is exact.
  const uint32_t u = __byte_perm(v, 0u, 0x1404);  // b1 << 24 | b0 << 8
  const uint32_t bits = (u & 0x80008000u) | ((u & 0x7F007F00u) >> 4);
  const __nv_bfloat162 two120 = __halves2bfloat162(__ushort_as_bfloat16(0x7B80), __ushort_as_bfloat16(0x7B80));
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), two120);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// ---- warp reductions (all 32 lanes must call) ------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// One kv head of an fp8 KV cache row (ops.h KvLayer), by one warp whose lane holds elements lane + 32 j (x: the
// values as the activations' dtype holds them): s = amax / 448 (1 for zeros), dst = e4m3(x / s), *scale = s.
template <int NJ>
__device__ __forceinline__ void store_fp8_head(const float (&x)[NJ], uint8_t* dst, float* scale) {
  const int lane = threadIdx.x & 31;
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) amax = fmaxf(amax, fabsf(x[j]));
  amax = warp_max(amax);
  const float s = amax > 0.f ? amax / 448.0f : 1.0f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) dst[lane + 32 * j] = __nv_cvt_float_to_fp8(x[j] / s, __NV_SATFINITE, __NV_E4M3);
  if (lane == 0) *scale = s;
}
// Sum over the block (every thread must call; returns the total to all; reusable back to back).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float red[32];
  __shared__ float total;
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < int(blockDim.x >> 5) ? red[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// ---- chained launches (programmatic dependent launch, sm_90+) ---------------------------------
// A kernel started with launch_chained may begin while the kernel before it on the stream is still
// finishing. It calls grid_release() first (so the kernel after it can be scheduled early), may read
// what no earlier kernel writes (weights), and calls grid_wait() before it touches anything earlier
// work writes or reads. On sm_90+ it is a programmatic dependent launch unless QWEN_RT_PDL=0 (measured
// on the H200, Qwen3-8B batch 1: 4.137 ms per step chained, 4.417 not; docs/PERFORMANCE_HISTORY.md).
__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Whether the calling thread's current device takes chained launches (queried once per thread: a
// rank's thread stays on its device).
bool chained_launch_supported();

template <typename... KArgs, typename... Args>
void launch_chained(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = chained_launch_supported() ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
  if (e != cudaSuccess) {  // named by the kernel's (mangled) name: the op's own check after it is not reached
    const char* name = nullptr;
    cudaGetLastError();
    if (cudaFuncGetName(&name, reinterpret_cast<const void*>(kernel)) != cudaSuccess || !name) name = "a kernel";
    check(e, str_cat("launch of ", name).c_str());
  }
}

// SwiGLU of one gate and up value, fp32: every kernel that applies it (silu_mul, the gated GEMV) uses this.
__device__ __forceinline__ float silu_mul1(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// ---- element conversions ---------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// 1 / rms of the n values at p (the warp's lanes take every 32nd, then warp_sum): an RMSNorm's multiplier.
template <typename T>
__device__ __forceinline__ float warp_inv_rms(const T* p, int n, float eps) {
  float ss = 0.f;
  for (int i = int(threadIdx.x & 31); i < n; i += 32) {
    const float v = to_f(p[i]);
    ss += v * v;
  }
  return 1.0f / sqrtf(warp_sum(ss) / float(n) + eps);
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// 16 bytes of T, converted to fp32 on load and rounded back to T on store.
template <typename T>
struct Vec16 {
  static constexpr int N = 16 / int(sizeof(T));
  float f[N];
  __device__ __forceinline__ void load(const T* p) {
    alignas(16) T e[N];
    *reinterpret_cast<uint4*>(e) = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = to_f(e[k]);
  }
  __device__ __forceinline__ void store(T* p) const {
    alignas(16) T e[N];
#pragma unroll
    for (int k = 0; k < N; ++k) e[k] = from_f<T>(f[k]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(e);
  }
};

// Element i of a float tensor of run-time dtype (F32, F16, BF16, F8E4M3).
__device__ __forceinline__ float load_any(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F16: return __half2float(static_cast<const __half*>(p)[i]);
    case DType::BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::F8E4M3: {
      __nv_fp8_e4m3 v;
      v.__x = static_cast<const __nv_fp8_storage_t*>(p)[i];
      return float(v);
    }
    default: return 0.f;
  }
}
__device__ __forceinline__ void store_any(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = v; break;
    case DType::F16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case DType::BF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::F8E4M3: static_cast<__nv_fp8_e4m3*>(p)[i] = __nv_fp8_e4m3(v); break;
    default: break;
  }
}

inline bool is_float_dtype(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::F8E4M3;
}

// Throws unless t has an activation dtype (F32, F16, BF16).
inline void check_act(const Tensor& t, const char* op) {
  QRT_CHECK(t.dtype == DType::F32 || t.dtype == DType::F16 || t.dtype == DType::BF16, "cuda ", op,
            ": unsupported activation dtype ", dtype_name(t.dtype));
}

// Calls f(T{}) with T the C++ type of an activation dtype (F32, F16, BF16).
template <typename F>
void dispatch_act(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F16: f(__half{}); break;
    case DType::BF16: f(__nv_bfloat16{}); break;
    default: throw std::runtime_error(str_cat("cuda ", op, ": unsupported activation dtype ", dtype_name(t)));
  }
}

// ---- kernels' host launchers (all stream-ordered, no synchronization) ------------------------
void launch_fill_random(Tensor& t, uint64_t seed, float scale, float offset, int64_t row0, int64_t col0,
                        cudaStream_t s);
void launch_convert(const Tensor& src, Tensor& dst, cudaStream_t s);
void launch_scale_columns(Tensor& w, const Tensor& gain, bool zc, cudaStream_t s);
void launch_embedding(const int32_t* ids, const Tensor& table, Tensor& out, cudaStream_t s);
void launch_rms_norm(const Tensor* residual_in, const Tensor& x, const Tensor& w, float eps, bool zc,
                     Tensor* residual, Tensor& out, cudaStream_t s);
void launch_head_rms_norm(Tensor& x, int head_dim, const Tensor& w, float eps, bool zc, cudaStream_t s);
void launch_rope(Tensor& x, int head_dim, const int32_t* positions, const RopeTable& tab, cudaStream_t s);
void launch_silu_mul(const Tensor& gate_up, Tensor& out, cudaStream_t s);
// Few-row linear (M <= gemv_max_rows(K) in gemv.cu: 1, or 4 for K <= 3072, by default; 16-bit x and w): out = x @ w^T
// (+ bias) stored, added to out (Add: linear_add), or, for SiluMul, out = silu(x . w[:N]^T) * (x . w[N:]^T)
// with N = out.cols. With norm, the rows of x are RMS-normalized first, inside the kernel (norm_linear; only
// a norm with unit_gain, and only when gemv_folds_norms()). Returns false (nothing launched) when the shapes,
// dtypes or norm are not the GEMV's.
enum class GemvEpilogue { Store, Add, SiluMul };
// A GEMV's result for output element n of one x row at o (T: x's dtype): Store s (+ bias[n]); Add s, rounded to O,
// onto *o; SiluMul silu(s) * s_up of the two rounded to T (what linear, then add or silu_mul, gives).
template <typename T, typename O, GemvEpilogue EPI>
__device__ __forceinline__ void gemv_store(O* o, float s, float s_up, const void* bias, DType bias_t, int64_t n) {
  if constexpr (EPI == GemvEpilogue::SiluMul) {
    *o = from_f<O>(silu_mul1(to_f(from_f<T>(s)), to_f(from_f<T>(s_up))));
  } else if constexpr (EPI == GemvEpilogue::Add) {
    *o = from_f<O>(to_f(*o) + to_f(from_f<O>(s)));
  } else {
    const float b = bias ? load_any(bias, bias_t, n) : 0.f;
    *o = from_f<O>(s + b);
  }
}
// Whether norm_linear GEMVs normalize inside the kernel (QWEN_RT_NORM_GEMV=off: no); models fold the
// gains into the weights only then.
bool gemv_folds_norms();
bool launch_gemv(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, GemvEpilogue epilogue,
                 const RmsNorm* norm, int num_sms, cudaStream_t s);
// Fused Backend::finish_qkv; returns false (nothing launched) for shapes it does not take.
bool launch_finish_qkv(Tensor& qkv, const AttnShape& sh, const Tensor* q_norm, const Tensor* k_norm, float eps,
                       bool zc, const int32_t* positions, const RopeTable& tab, const AttnBatch& b, KvLayer& cache,
                       cudaStream_t s);
// W8A8 on sm_90a through CUTLASS (fp8_gemm_sm90.cu): out [M, N] (+)= (x8 x_scale) @ (w8 w_scale)^T; x8 e4m3 [M, K]
// (row stride K), x_scale [K / 128][scale_rows] (scale_rows >= M, a multiple of 4); w8 e4m3 [N, K] (row stride ldw),
// w_scale_t [K / 128][N / 128]; K and N multiples of 128; out bf16 or fp16. False (nothing run) where this build has
// no CUTLASS or the shape is refused.
bool launch_fp8_block_gemm(int64_t M, int64_t N, int64_t K, const void* x8, const float* x_scale, int64_t scale_rows,
                           const void* w8, int64_t ldw, const float* w_scale_t, void* out, int64_t ldo, DType out_t,
                           bool accumulate, void* workspace, size_t ws_bytes, cudaStream_t st);
// Backend::copy_segments with the list in device memory: a block per segment.
void launch_copy_segments(const CopySegment* segs, int n, cudaStream_t s);
// Backend::write_kv into an fp8 cache (k and v in the activations' dtype, any head_dim).
void launch_write_kv_fp8(const Tensor& k, const Tensor& v, const AttnBatch& b, const KvLayer& cache, cudaStream_t s);
void launch_add(Tensor& x, const Tensor& y, cudaStream_t s);
void launch_fill_tokens(int32_t* ids, const int32_t* src_index, const int32_t* src, int n, cudaStream_t s);
// One thread that spins for ms milliseconds (tests: a step that does not finish in time).
void launch_stall(double ms, cudaStream_t s);
void launch_add_bias(Tensor& out, const Tensor& bias, cudaStream_t s);
// Row copies: dst[dst_rows ? dst_rows[i] : i] = src[src_rows ? src_rows[i] : i] for i < n,
// row_elems elements each; src/dst dtypes may differ (converted).
void launch_copy_rows(const void* src, DType st, int64_t src_stride, const int32_t* src_rows, void* dst,
                      DType dt, int64_t dst_stride, const int32_t* dst_rows, int64_t n, int64_t row_elems,
                      cudaStream_t s);

// Gated DeltaNet and gated attention (gdn.cu): Backend::sigmoid_mul, gated_rms_norm, causal_conv1d and
// gated_delta_rule (ops.h).
void launch_sigmoid_mul(Tensor& x, const Tensor& gate, cudaStream_t s);
void launch_gated_rms_norm(Tensor& x, const Tensor& z, const Tensor& w, float eps, int head_dim, cudaStream_t s);
void launch_causal_conv1d(const Tensor& x, const Tensor& w, const AttnBatch& b, const DeltaNetShape& sh,
                          StateLayer& st, Tensor& out, cudaStream_t s);
// How a call of the gated delta rule runs: sequences of chunk_min rows or more with a state slot in chunks of 64 on
// tensor cores (kNone: every sequence on the token loop; 16-bit activations, key heads of 64 or 128, value heads
// of a multiple of 32 up to 128, no kept states), the rest on the token loop; the chunks' records go through a
// scratch of scratch_bytes, window chunk slots at a time, of at most `slots`. QWEN_RT_DELTA_RULE=loop: the token
// loop for every sequence; QWEN_RT_DELTA_RULE_WINDOW=n: windows of n slots; both read at every call. Qwen3.8-27B
// bf16, 8k-token prefill on an H100: 866 against 1,191 ms with the token loop (docs/PERFORMANCE.md).
struct DeltaRulePlan {
  static constexpr int kNone = 1 << 30;
  int chunk_min = kNone;
  int64_t slots = 0, window = 0;
  size_t scratch_bytes = 0;
};
DeltaRulePlan plan_delta_rule(const Tensor& qkv, const AttnBatch& b, const DeltaNetShape& sh, const Tensor& out);
void launch_gated_delta_rule(const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& a_log,
                             const Tensor& dt_bias, const AttnBatch& batch, const DeltaNetShape& sh, StateLayer& st,
                             Tensor& out, const DeltaRulePlan& plan, void* scratch, cudaStream_t s);

// Sparse decode (sparse.cu): Backend::summarize_pages and select_pages.
void launch_summarize_pages(const KvLayer& cache, const AttnBatch& b, int kv_cols, cudaStream_t s);
void launch_select_pages(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
                         const SparseAttention& rule, float* scores, int32_t* pages, int32_t* keys, cudaStream_t s);

// Attention (attention.cu). Workspace comes from the caller (grown as needed by attn_workspace_bytes).
struct AttnWorkspace {
  float* partial = nullptr;  // split partial outputs
  size_t bytes = 0;
};
size_t attn_workspace_bytes(const AttnBatch& b, const AttnShape& sh, int num_sms);
void launch_attention(const Tensor& q, const KvLayer& cache, const AttnBatch& b, const AttnShape& sh,
                      Tensor& out, const AttnWorkspace& ws, int num_sms, cudaStream_t s);
// finish_qkv's inputs (ops.h), for launch_qkv_attention.
struct QkvFinish {
  const Tensor* q_norm = nullptr;
  const Tensor* k_norm = nullptr;
  float eps = 0.f;
  bool zero_centred = false;
  const int32_t* positions = nullptr;
  const RopeTable* table = nullptr;
};
// finish_qkv of qkv and the attention of its q in one decode kernel (qkv itself is left as it was), when
// the batch is one the decode kernel takes; otherwise returns false having done nothing.
bool launch_qkv_attention(const Tensor& qkv, const QkvFinish& fin, const KvLayer& cache, const AttnBatch& b,
                          const AttnShape& sh, Tensor& out, const AttnWorkspace& ws, int num_sms, cudaStream_t s);

// Sampling (sampling.cu).
struct SampleParamsDev {  // one row's parameters, as the kernel reads them
  float inv_temperature;  // 0: greedy
  float top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
  int top_k, num_logprobs;
  uint64_t seed;
  int64_t draw;
  int banned_off, banned_n, seen_off, seen_n, out_off, out_n;  // into the int list (out: tokens then counts)
  int has_lists;  // banned tokens or penalties: the kernel works on a copy of the row in scratch
};
// stats: sample_stats_bytes(rows, vocab) of device scratch; scratch: rows * vocab floats when a row has_lists.
int64_t sample_stats_chunks(int64_t vocab);
inline size_t sample_stats_bytes(int64_t rows, int64_t vocab) { return size_t(rows * sample_stats_chunks(vocab)) * 16; }
void launch_sample(const float* logits, int64_t rows, int64_t vocab, int64_t stride, const SampleParamsDev* params,
                   const int32_t* lists, void* stats, float* scratch, int max_n, int32_t* tok_out, float* lp_out,
                   int32_t* top_ids, float* top_lps, cudaStream_t s);

}  // namespace qrt::cuda
