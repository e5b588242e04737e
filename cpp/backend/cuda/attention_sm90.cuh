// Hopper prefill attention: the tile kernel's job (attention.cu) on warpgroup MMA (wgmma, sm_90a).
// Included by attention.cu inside its namespace; it uses TileArgs, KvHead, pack2 and the cp.async helpers.
//
// A block is WG warpgroups of 64 (token, head) rows each, for one sequence and one kv head, the rows as the
// tile kernel maps them (row r: token r / G, query head r % G). Q, and K/V in STAGES stages of BN keys, sit in
// shared memory in the layout wgmma reads with 128-byte swizzle: a [rows][D] tile is D / 64 panels of
// [rows][64] elements, row r's 16-byte chunk c of a panel at r * 128 + ((c ^ (r % 8)) * 16). Per tile of keys:
// S = Q K^T (both operands from shared memory, K-major), the causal mask and online softmax in registers
// (log2 units, as the tile kernel), then O += P V with P from registers and V read transposed (MN-major).
// The softmax of a tile runs while the tensor cores do the previous tile's P V where the registers allow
// (kSoftmaxUnderPV), else a warpgroup takes one tile at a time. Loads and meetings (PIPE):
// - kPipeOverlap: every thread loads K/V tiles by cp.async; the block meets at a barrier per tile.
// - kPipeProducer: a producer warpgroup alone loads Q and K/V (cp.async, completion signalled on a per-stage
//   mbarrier) and hands most of its registers to the others; the computing warpgroups go at their own pace and
//   hand a stage back on a second mbarrier once their P V has read it.
// - kPipePingPong: kPipeProducer, and the computing warpgroups issue their MMAs in turn.

#define QRT_WGMMA_SS_N64(TY)                                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                      \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                                      \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                        \
               "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                                   \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),             \
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),         \
                 "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),      \
                 "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),      \
                 "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                              \
               : "l"(da), "l"(db), "r"(acc))

#define QRT_WGMMA_SS_N128(TY)                                                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                      \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                                     \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
               "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
               "%59, %60, %61, %62, %63}, "                                                                      \
               "%64, %65, p, 1, 1, 0, 0;\n}\n"                                                                   \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),             \
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),         \
                 "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),      \
                 "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),      \
                 "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),      \
                 "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),      \
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),      \
                 "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),      \
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),      \
                 "+f"(d[63])                                                                                     \
               : "l"(da), "l"(db), "r"(acc))

#define QRT_WGMMA_RS_N64(TY)                                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                      \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {"                                      \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                                        \
               "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                                     \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),             \
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),         \
                 "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),      \
                 "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),      \
                 "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc))

#define QRT_WGMMA_RS_N128(TY)                                                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                      \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {"                                     \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
               "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
               "%59, %60, %61, %62, %63}, "                                                                      \
               "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                                     \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),             \
                 "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),         \
                 "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),      \
                 "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),      \
                 "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),      \
                 "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),      \
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),      \
                 "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),      \
                 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),      \
                 "+f"(d[63])                                                                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc))

// D (+)= A B for one warpgroup: A 64 x 16 (from shared memory by descriptor da, or four registers a per
// thread), B 16 x N by descriptor db; d holds N / 2 fp32 accumulators per thread (mma.m16n8 layout per warp
// and 8 columns). acc 0 overwrites d.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) {
  static_assert(N == 64 || N == 128, "wgmma_ss: N is 64 or 128");
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    if constexpr (N == 64) QRT_WGMMA_SS_N64("bf16");
    else QRT_WGMMA_SS_N128("bf16");
  } else {
    if constexpr (N == 64) QRT_WGMMA_SS_N64("f16");
    else QRT_WGMMA_SS_N128("f16");
  }
}
// B transposed (MN-major: N contiguous in shared memory).
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int acc) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N is 64 or 128");
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    if constexpr (N == 64) QRT_WGMMA_RS_N64("bf16");
    else QRT_WGMMA_RS_N128("bf16");
  } else {
    if constexpr (N == 64) QRT_WGMMA_RS_N64("f16");
    else QRT_WGMMA_RS_N128("f16");
  }
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across the asynchronous MMAs.
template <int N> __device__ __forceinline__ void wgmma_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// A shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t(lead >> 4) << 16) | (uint64_t(stride >> 4) << 32) |
         (uint64_t(1) << 62);
}

// Byte offset of 16-byte chunk `c` (of D / 8) of row r in a [rows][D] tile of 128-byte swizzled panels.
__device__ __forceinline__ uint32_t swizzled(int rows, int r, int c) {
  return uint32_t((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

__device__ __forceinline__ void cp_async16_to(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// The barrier's arrival, once every cp.async this thread issued before has landed (counted in its init).
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase with this parity has completed. A wait past 10 s (a stage that never lands: a
// bug) traps, so the launch fails with an error instead of hanging the device.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = global_ns();
  while (!mbar_try_wait(bar, parity))
    if (global_ns() - t0 > 10000000000ull) __trap();
}

// Named barriers 1.. (0 is __syncthreads'): `threads` (a multiple of 32) meet; arrive does not wait.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// cp.async writes (generic proxy) -> wgmma reads (async proxy) of shared memory.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// How a block loads and meets (see the top of this file).
enum WgmmaPipe { kPipeOverlap = 0, kPipeProducer = 1, kPipePingPong = 2 };

template <int D, int BN, int WG, int STAGES, int PIPE> struct WgmmaCfg {
  static constexpr int BM = 64 * WG;  // rows per block
  static constexpr bool kProducer = PIPE != kPipeOverlap;  // a producer warpgroup loads
  static constexpr int kThreads = 128 * WG + (kProducer ? 128 : 0);
  // kPipeProducer's registers per thread: the producer warpgroup gives its registers up to the computing ones.
  static constexpr int kProducerRegs = 40;
  static constexpr int kComputeRegs = std::min(256, (65536 - 128 * kProducerRegs) / (128 * WG)) & ~7;  // setmaxnreg's most
  static constexpr int kQBytes = BM * D * 2;
  static constexpr int kKvBytes = BN * D * 2;  // K or V of one stage
  // ptxas (CUDA 13.0) keeps wgmma asynchronous only within the registers a thread has at launch (65536 /
  // kThreads, whatever setmaxnreg grants later; beyond them it spilled and serialized every wgmma): the softmax
  // runs under the previous tile's P V only where O, S, P and ~24 more fit.
  static constexpr bool kSoftmaxUnderPV = D / 2 + BN / 2 + BN / 4 + 24 <= 65536 / kThreads;
  static constexpr size_t smem = 1024 + kQBytes + size_t(STAGES) * 2 * kKvBytes;  // + alignment of the panels
};

template <typename T, int D, int BN, int WG, int STAGES, int PIPE>
__global__ void __launch_bounds__(WgmmaCfg<D, BN, WG, STAGES, PIPE>::kThreads, 1) attn_wgmma_kernel(const TileArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = WgmmaCfg<D, BN, WG, STAGES, PIPE>;
  constexpr int BM = Cfg::BM, NT = BN / 8, ND = D / 8;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t q_s = (uint32_t(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;  // panels 1024-aligned
  auto k_s = [&](int stage) { return q_s + Cfg::kQBytes + uint32_t(stage) * 2 * Cfg::kKvBytes; };

  // wg through a shuffle: the compiler then knows it is warp-uniform, as the producer branch's .aligned
  // instructions (setmaxnreg) need.
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), warp = (tid >> 5) & 3, lane = tid & 31;
  QTile qt;
  if (!q_tile(a, qt)) return;
  const int G = qt.G, base_pos = qt.base_pos, max_pos = qt.max_pos;
  const int n_tiles = (qt.n_keys + BN - 1) / BN;
  const KvHead<T> cache = kv_head<T, D>(a, qt.s, qt.kvh);

  // With a producer: stage st is loaded when full[st] completes a phase, free again when empty[st] does.
  __shared__ __align__(8) uint64_t bars[2 * STAGES];
  const uint32_t full0 = uint32_t(__cvta_generic_to_shared(bars)), empty0 = full0 + 8 * STAGES;
  if constexpr (Cfg::kProducer) {
    if (tid == 0) {
      for (int st = 0; st < STAGES; ++st) {
        mbar_init(full0 + 8 * st, 128);     // every producer thread
        mbar_init(empty0 + 8 * st, 4 * WG);  // every computing warp
      }
    }
    __syncthreads();
    if (wg == WG) {  // the producer warpgroup
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Cfg::kProducerRegs));
      const int me = tid - 128 * WG, pw = me >> 5;
      for_q_parts<T, D, BM, 128>(a, qt, [&](int r, int part, const T* src, bool ok) {
        cp_async16_to(q_s + swizzled(BM, r, part), src, ok);
      }, me);
      // Producer warp pw loads keys pw * kKeys .. + kKeys of a tile: lane l finds the cache row of key l % kKeys;
      // each step, lanes take 16-byte parts of kKeysPerStep consecutive keys (a key's row is contiguous).
      constexpr int kKeys = BN / 4, kLanesPerKey = D / 8, kKeysPerStep = 32 / kLanesPerKey;
      static_assert(kKeys <= 32 && kKeys % kKeysPerStep == 0, "attn_wgmma_kernel: producer key split");
      const int part = lane % kLanesPerKey, sub = lane / kLanesPerKey;
      for (int j = 0; j < n_tiles; ++j) {
        const int st = j % STAGES;
        if (j >= STAGES) mbar_wait(empty0 + 8 * st, uint32_t((j / STAGES - 1) & 1));
        const int mine = j * BN + pw * kKeys + lane % kKeys;
        bool my_host = false;
        const int64_t my_row = mine < qt.n_keys ? cache.row(mine, my_host) : -1;
        const uint32_t ks = k_s(st), vs = ks + Cfg::kKvBytes;
#pragma unroll
        for (int i = 0; i < kKeys; i += kKeysPerStep) {
          const int64_t crow = __shfl_sync(0xffffffffu, my_row, i + sub);
          const bool on_host = __shfl_sync(0xffffffffu, my_host, i + sub);
          const bool ok = crow >= 0;
          const uint32_t off = swizzled(BN, pw * kKeys + i + sub, part);
          const KvPtr<T> kv = cache.at(ok ? crow : 0, ok && on_host);
          cp_async16_to(ks + off, kv.k + part * 8, ok);
          cp_async16_to(vs + off, kv.v + part * 8, ok);
        }
        mbar_arrive_cp_async(full0 + 8 * st);  // Q joins tile 0
      }
      cp_async_wait<0>();
      return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Cfg::kComputeRegs));
  } else {
    for_q_parts<T, D, BM, Cfg::kThreads>(a, qt, [&](int r, int part, const T* src, bool ok) {
      cp_async16_to(q_s + swizzled(BM, r, part), src, ok);
    }, tid);
  }
  // Tile j of keys into stage j % STAGES (keys past the end are zeros); a group is committed either way.
  auto issue = [&](int j) {
    if (j < n_tiles) {
      const uint32_t ks = k_s(j % STAGES), vs = ks + Cfg::kKvBytes;
      for_kv_parts<T, D, BN, Cfg::kThreads>(cache, j, qt.n_keys,
                                            [&](int i, int part, const T* k_src, const T* v_src, bool ok) {
        const uint32_t off = swizzled(BN, i, part);
        cp_async16_to(ks + off, k_src, ok);
        cp_async16_to(vs + off, v_src, ok);
      }, tid);
    }
    cp_async_commit();
  };
  // Tile j - 1's V is read while tile j is computed, so loads run STAGES - 2 tiles ahead.
  static_assert(STAGES >= 3, "attn_wgmma_kernel: takes 3 or more stages");
  if constexpr (PIPE == kPipeOverlap) {
#pragma unroll
    for (int j = 0; j < STAGES - 2; ++j) issue(j);  // Q joins the first group
  }

  // This thread's accumulator rows: row0 (elements 0, 1 of each 8 columns) and row0 + 8 (2, 3).
  const int row0 = wg * 64 + warp * 16 + (lane >> 2);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max of the raw scores, sum of exp2
  const float scale = a.scale_log2;
  const uint32_t q_rows = q_s + uint32_t(wg) * 64 * 128;  // this warpgroup's 64 rows of every Q panel

  // Every thread's part of tile j is in shared memory, fenced for wgmma, then the block meets.
  auto landed = [&]() {
    fence_async_shared();
    __syncthreads();
  };
  float sc[BN / 2];         // S, then P in fp32
  // P packed as the A fragments of O += P V, 16 keys each: in pa where the softmax runs under P V, else in the
  // first BN / 4 elements of sc (each packed pair lands at or before the pair it is made of).
  uint32_t pa[Cfg::kSoftmaxUnderPV ? BN / 16 : 1][4];
  // S = Q K^T (raw scores) of tile j: D / 16 steps of 16 dimensions, each inside one 64-wide panel.
  auto qk = [&](int j) {
    const uint32_t ks = k_s(j % STAGES);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t koff = uint32_t(kk & 3) * 32;  // 16 dimensions = 32 bytes into the swizzled row
      wgmma_ss<T, BN>(sc, smem_desc(q_rows + uint32_t(kk >> 2) * BM * 128 + koff, 0, 1024),
                      smem_desc(ks + uint32_t(kk >> 2) * BN * 128 + koff, 0, 1024), kk > 0);
    }
    wgmma_commit();
  };
  // O += P V of tile j; V is MN-major (its 64-wide panels BN * 128 bytes apart, groups of 8 keys 1024 apart).
  // head_dim 256: two MMAs of 128 columns (panels 0-1 into o[0 .. 63], panels 2-3 into o[64 .. 127]; the
  // accumulators of 8 columns stay 4 floats apart throughout).
  constexpr int PVN = D > 128 ? 128 : D;
  auto pv = [&](int j) {
    const uint32_t vs = k_s(j % STAGES) + Cfg::kKvBytes;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int half = 0; half < D / PVN; ++half) {
        const uint64_t dv = smem_desc(vs + uint32_t(half * (PVN / 64) * BN * 128 + kk * 16 * 128), BN * 128, 1024);
        float (&oh)[PVN / 2] = *reinterpret_cast<float (*)[PVN / 2]>(o + half * (PVN / 2));
        if constexpr (Cfg::kSoftmaxUnderPV) {
          wgmma_rs<T, PVN>(oh, pa[kk], dv, 1);
        } else {
          const uint32_t f[4] = {__float_as_uint(sc[4 * kk]), __float_as_uint(sc[4 * kk + 1]),
                                 __float_as_uint(sc[4 * kk + 2]), __float_as_uint(sc[4 * kk + 3])};
          wgmma_rs<T, PVN>(oh, f, dv, 1);
        }
      }
    }
    wgmma_commit();
  };
  // Causal mask and online softmax of tile j's scores (P = exp2 in sc); al: the factor for O.
  auto softmax = [&](int j, float (&al)[2]) {
    if ((j + 1) * BN - 1 > base_pos) {
      const int pos0 = min(base_pos + row0 / G, max_pos);  // a row's last visible key (rows past the end:
      const int pos1 = min(base_pos + (row0 + 8) / G, max_pos);  // the tile's last token's)
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int key = j * BN + i * 8 + (lane & 3) * 2;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key + (e & 1) > (e < 2 ? pos0 : pos1)) sc[4 * i + e] = -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY}, neg[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], sc[i]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float mn = fmaxf(m[h], mx[h]);  // finite: every row sees key 0 in the first tile
      al[h] = m[h] == -INFINITY ? 0.f : exp2f((m[h] - mn) * scale);
      neg[h] = -mn * scale;
      m[h] = mn;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      sc[i] = exp2f(fmaf(sc[i], scale, neg[(i >> 1) & 1]));
      sum[(i >> 1) & 1] += sc[i];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * al[h] + sum[h];
  };
  auto rescale_and_pack = [&](const float (&al)[2]) {
    // Once the rows' maxima settle, al is exactly 1 and a warp skips the multiplications.
    if (__any_sync(0xffffffffu, al[0] != 1.f || al[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] *= al[(i >> 1) & 1];
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const uint32_t packed = pack2<T>(sc[8 * kk + 2 * e], sc[8 * kk + 2 * e + 1]);
        if constexpr (Cfg::kSoftmaxUnderPV) pa[kk][e] = packed;
        else sc[4 * kk + e] = __uint_as_float(packed);
      }
    }
  };

  float al[2];
  auto arrived = [&](int j) {  // tile j is in shared memory, visible to wgmma
    if constexpr (Cfg::kProducer) {
      mbar_wait(full0 + 8 * (j % STAGES), uint32_t((j / STAGES) & 1));
      fence_async_shared();
    } else {
      issue(j + STAGES - 2);
      cp_async_wait<STAGES - 2>();
      landed();
    }
  };
  auto release = [&](int j) {  // tile j's P V has completed: its stage may be refilled
    if constexpr (Cfg::kProducer) {
      if (lane == 0) mbar_arrive(empty0 + 8 * (j % STAGES));
    } else {
      __syncthreads();
    }
  };
  // kPipePingPong: the computing warpgroups issue their MMAs in turn (0, 1, .., WG - 1, 0, ..), so one's softmax
  // runs under the others' MMAs. Warpgroup w takes its turn at named barrier 1 + w, where the one before it
  // arrives once it has issued; the last one opens the first turn and does not pass its last.
  static_assert(PIPE != kPipePingPong || WG >= 2, "attn_wgmma_kernel: ping-pong takes 2 or more warpgroups");
  auto take_turn = [&]() {
    if constexpr (PIPE == kPipePingPong) named_sync(1 + wg, 256);
  };
  auto pass_turn = [&](bool last) {
    if constexpr (PIPE == kPipePingPong)
      if (!last || wg != WG - 1) named_arrive(1 + (wg + 1) % WG, 256);
  };
  if (PIPE == kPipePingPong && wg == WG - 1) named_arrive(1, 256);

  if constexpr (Cfg::kSoftmaxUnderPV) {
    // P V of tile j - 1 runs on the tensor cores while tile j's softmax runs.
    arrived(0);
    take_turn();
    wgmma_fence();
    qk(0);
    pass_turn(false);
    wgmma_wait<0>();
    wgmma_hold(sc);
    softmax(0, al);
    rescale_and_pack(al);
    for (int j = 1; j < n_tiles; ++j) {
      arrived(j);
      take_turn();
      wgmma_fence();
      qk(j);
      pv(j - 1);
      pass_turn(false);
      wgmma_wait<1>();  // S of tile j (P V of tile j - 1 may still run)
      wgmma_hold(sc);
      softmax(j, al);
      wgmma_wait<0>();
      wgmma_hold(o);
      release(j - 1);
      rescale_and_pack(al);
    }
    take_turn();
    wgmma_fence();
    pv(n_tiles - 1);
    pass_turn(true);
    wgmma_wait<0>();
    wgmma_hold(o);
  } else {
    // One tile at a time: S, softmax, P V.
    for (int j = 0; j < n_tiles; ++j) {
      arrived(j);
      take_turn();
      wgmma_fence();
      qk(j);
      pass_turn(j == n_tiles - 1);
      wgmma_wait<0>();
      wgmma_hold(sc);
      softmax(j, al);
      rescale_and_pack(al);
      wgmma_fence();
      pv(j);
      wgmma_wait<0>();
      wgmma_hold(o);
      release(j);
    }
  }
  cp_async_wait<0>();

  T* out = static_cast<T*>(a.out);
  const int col = (lane & 3) * 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = l[h];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    const float inv = 1.f / total;
    const int r = row0 + h * 8;
    if (r >= qt.rows_valid) continue;
    T* p = out + qt.row_offset(r, a.out_stride, D) + col;
#pragma unroll
    for (int i = 0; i < ND; ++i)
      *reinterpret_cast<uint32_t*>(p + i * 8) = pack2<T>(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
  }
#else
  __trap();  // launched only on sm_90 with an sm_90a image (prefill_form)
#endif
}
