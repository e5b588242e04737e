// Standalone study of batch-1 GEMV bandwidth on the decode step's real shapes (Qwen3-8B: 36 layers of
// q|k|v 6144x4096, o 4096x4096, gate|up 24576x4096, down 4096x12288; distinct weights per layer so nothing
// stays in L2). Each variant runs the 144 GEMVs of a step as one CUDA graph; the figure is weight bytes /
// graph time, next to a device-to-device copy of the same bytes.
//   nvcc -O3 -arch=sm_90 -std=c++17 tools/gemv_study.cu -o /tmp/gemv_study && /tmp/gemv_study
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));     \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 u = __bfloat1622float2(pa[i]), v = __bfloat1622float2(pb[i]);
    s = fmaf(u.x, v.x, s);
    s = fmaf(u.y, v.y, s);
  }
  return s;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {  // weights: read once, do not keep in L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// A: the runtime's current design: one warp per weight row, U pieces in flight per lane, 8 warps a block.
template <int U, bool NA, bool PDL>
__global__ void __launch_bounds__(256) gemv_a(const bf16* x, const bf16* w, bf16* out, int N, int K) {
  if (PDL) pdl_release();
  const int n = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + size_t(n) * K);
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  const int chunks = K / 8;
  uint4 wv[U];
#pragma unroll
  for (int u = 0; u < U; ++u) wv[u] = NA ? ld_stream(wr + lane + 32 * u) : __ldg(wr + lane + 32 * u);
  if (PDL) pdl_wait();
  float acc = 0.f;
  int c = lane;
  for (;;) {
    const bool more = c + 32 * U + 32 * (U - 1) < chunks;
    uint4 nx[U];
    if (more)
#pragma unroll
      for (int u = 0; u < U; ++u) nx[u] = NA ? ld_stream(wr + c + 32 * U + 32 * u) : __ldg(wr + c + 32 * U + 32 * u);
#pragma unroll
    for (int u = 0; u < U; ++u) acc += dot8(__ldg(xr + c + 32 * u), wv[u]);
    c += 32 * U;
    if (!more) break;
#pragma unroll
    for (int u = 0; u < U; ++u) wv[u] = nx[u];
  }
  for (; c < chunks; c += 32) acc += dot8(__ldg(xr + c), NA ? ld_stream(wr + c) : __ldg(wr + c));
  acc = warp_sum(acc);
  if (lane == 0) out[n] = __float2bfloat16(acc);
}

// B: S warps share one row (each a contiguous K/S part); x staged in shared memory once per block;
// persistent grid (row groups strided by the grid), the next group's first pieces load before the
// reduction of this one.
template <int U, int S, bool PDL>
__global__ void __launch_bounds__(256) gemv_b(const bf16* x, const bf16* w, bf16* out, int N, int K) {
  extern __shared__ uint4 xs[];
  constexpr int RPB = 8 / S;  // rows per block per group
  __shared__ float part[8];
  if (PDL) pdl_release();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = warp / S, s = warp % S;
  const int chunks = K / 8, per = chunks / S;  // K/8 divisible by S assumed
  const int groups = (N + RPB - 1) / RPB;
  auto row_ptr = [&](int g) {
    const int n = g * RPB + r;
    return reinterpret_cast<const uint4*>(w + size_t(n < N ? n : N - 1) * K) + s * per;
  };
  int g = blockIdx.x;
  uint4 wv[U];
  const uint4* wr = row_ptr(g);
  if (g < groups)
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (lane + 32 * u < per) wv[u] = ld_stream(wr + lane + 32 * u);
  if (PDL) pdl_wait();
  for (int i = threadIdx.x; i < chunks; i += 256) xs[i] = reinterpret_cast<const uint4*>(x)[i];
  __syncthreads();
  const uint4* xr = xs + s * per;
  for (; g < groups; g += gridDim.x) {
    float acc = 0.f;
    int c = lane;
    for (;;) {
      const int cn = c + 32 * U;
      const bool more = cn < per;
      uint4 nx[U];
      const uint4* wn = wr;
      int cl = cn;
      if (!more) {  // prefetch the next group's first pieces instead
        wn = row_ptr(g + gridDim.x);
        cl = lane;
      }
      const bool have = more || g + int(gridDim.x) < groups;
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (have && cl + 32 * u < per) nx[u] = ld_stream(wn + cl + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (c + 32 * u < per) acc += dot8(xr[c + 32 * u], wv[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) wv[u] = nx[u];
      if (!more) {
        wr = wn;
        break;
      }
      c = cn;
    }
    acc = warp_sum(acc);
    const int n = g * RPB + r;
    if (S == 1) {
      if (lane == 0 && n < N) out[n] = __float2bfloat16(acc);
    } else {
      if (lane == 0) part[warp] = acc;
      __syncthreads();
      if (s == 0 && lane == 0 && n < N) {
        float t = 0.f;
        for (int j = 0; j < S; ++j) t += part[r * S + j];
        out[n] = __float2bfloat16(t);
      }
      __syncthreads();
    }
  }
}

// Read ceiling: every block streams its share of the bytes, a grid of SMs * 8 blocks.
__global__ void __launch_bounds__(256) read_all(const uint4* p, size_t n, float* sink) {
  float acc = 0.f;
  for (size_t i = size_t(blockIdx.x) * 256 + threadIdx.x; i < n; i += size_t(gridDim.x) * 256) {
    const uint4 v = ld_stream(p + i);
    acc += __uint_as_float(v.x ^ v.y ^ v.z ^ v.w);
  }
  if (acc == 1.2345f) *sink = acc;
}

struct Shape {
  int N, K;
};

template <typename Kernel>
void launch(Kernel k, int grid, size_t smem, cudaStream_t s, bool pdl, const bf16* x, const bf16* w, bf16* o, int N,
            int K) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = 256;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = a;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, k, x, w, o, N, K));
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int L = 36;
  const std::vector<Shape> layer = {{6144, 4096}, {4096, 4096}, {24576, 4096}, {4096, 12288}};
  size_t per_layer = 0;
  for (auto& s : layer) per_layer += size_t(s.N) * s.K;
  const size_t elems = per_layer * L;
  const double bytes = double(elems) * 2;
  bf16 *w = nullptr, *x = nullptr, *o = nullptr;
  CK(cudaMalloc(&w, elems * 2));
  CK(cudaMalloc(&x, 12288 * 2 * 2));
  CK(cudaMalloc(&o, 24576 * 2 * 2));
  CK(cudaMemset(w, 0x3c, elems * 2));
  CK(cudaMemset(x, 0x3c, 12288 * 4));
  float* sink = nullptr;
  CK(cudaMalloc(&sink, 4));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::printf("GPU SMs %d, weights %.2f GB per step (%d GEMVs)\n", sms, bytes / 1e9, int(layer.size()) * L);

  auto time_graph = [&](auto enqueue) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    enqueue();
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    const int reps = 20;
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return ms / reps;
  };
  auto report = [&](const char* name, float ms) {
    std::printf("%-44s %8.3f ms  %6.3f TB/s\n", name, ms, bytes / (ms * 1e-3) / 1e12);
  };
  // Copy reference: D2D of half the bytes (reads + writes = the step's bytes).
  {
    bf16* dst = nullptr;
    CK(cudaMalloc(&dst, elems));
    const float ms = time_graph([&] { CK(cudaMemcpyAsync(dst, w, elems, cudaMemcpyDeviceToDevice, st)); });
    report("copy D2D (read+write = step bytes)", ms);
    CK(cudaFree(dst));
  }
  report("read-only stream, 8 blocks/SM", time_graph([&] {
           read_all<<<sms * 8, 256, 0, st>>>(reinterpret_cast<const uint4*>(w), elems / 8, sink);
         }));
  // Per layer-shape, one GEMV type at a time (the 36 of them).
  auto run_step = [&](auto one, bool only_shape, int which) {
    return time_graph([&] {
      size_t off = 0;
      for (int l = 0; l < L; ++l)
        for (int i = 0; i < int(layer.size()); ++i) {
          const Shape& s = layer[i];
          if (!only_shape || i == which) one(w + off, s.N, s.K);
          off += size_t(s.N) * s.K;
        }
    });
  };
  auto variant = [&](const char* name, auto one) {
    report(name, run_step(one, false, 0));
  };
#define A_VARIANT(U, NA, PDL)                                                                           \
  variant("A one warp/row U=" #U " na=" #NA " pdl=" #PDL, [&](const bf16* wp, int N, int K) {           \
    launch(gemv_a<U, NA, PDL>, (N + 7) / 8, 0, st, PDL, x, wp, o, N, K);                               \
  })
  A_VARIANT(4, false, false);
  A_VARIANT(4, true, false);
  A_VARIANT(8, true, false);
  A_VARIANT(4, true, true);
  A_VARIANT(8, true, true);
#define B_VARIANT(U, S, BPS, PDL)                                                                       \
  variant("B persist U=" #U " split=" #S " blocks/SM=" #BPS " pdl=" #PDL,                               \
          [&](const bf16* wp, int N, int K) {                                                          \
            const int groups = (N + 8 / S - 1) / (8 / S);                                              \
            const int grid = groups < sms * BPS ? groups : sms * BPS;                                  \
            launch(gemv_b<U, S, PDL>, grid, size_t(K) * 2, st, PDL, x, wp, o, N, K);                   \
          })
  CK(cudaFuncSetAttribute(gemv_b<4, 1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 24576));
  B_VARIANT(4, 1, 4, false);
  B_VARIANT(4, 1, 8, false);
  B_VARIANT(4, 2, 4, false);
  B_VARIANT(4, 2, 8, false);
  B_VARIANT(8, 2, 4, false);
  B_VARIANT(4, 4, 8, false);
  B_VARIANT(4, 1, 8, true);
  B_VARIANT(4, 2, 8, true);
  B_VARIANT(8, 2, 4, true);
  // Per shape, for the best-known A and one B: where the time goes.
  const char* names[] = {"qkv 6144x4096", "o 4096x4096", "gate_up 24576x4096", "down 4096x12288"};
  for (int i = 0; i < 4; ++i) {
    const double b = double(layer[i].N) * layer[i].K * 2 * L;
    const float ma = run_step([&](const bf16* wp, int N, int K) {
      launch(gemv_a<4, true, false>, (N + 7) / 8, 0, st, false, x, wp, o, N, K);
    }, true, i);
    const float mb = run_step([&](const bf16* wp, int N, int K) {
      const int groups = (N + 3) / 4, grid = groups < sms * 8 ? groups : sms * 8;
      launch(gemv_b<4, 2, false>, grid, size_t(K) * 2, st, false, x, wp, o, N, K);
    }, true, i);
    std::printf("  %-20s A: %6.2f us/call %5.2f TB/s   B(4,2,8): %6.2f us/call %5.2f TB/s\n", names[i],
                ma * 1e3 / L, b / (ma * 1e-3) / 1e12, mb * 1e3 / L, b / (mb * 1e-3) / 1e12);
  }
  return 0;
}
