// Decode attention alone, with the runtime's own kernels (attention.cu and kernels.cu compiled in), on a
// model's real head shapes: `layers` layers, each with its own paged cache (pages in shuffled order, so
// nothing stays in L2 from one layer to the next), run as the engine runs a decode step's attention
// (launch_qkv_attention, else finish_qkv then attention), captured as one CUDA graph. The figure is the K/V
// bytes the step must read / the graph's time per layer, beside the rate of a 2 GiB device-to-device copy.
//   nvcc -O3 -arch=sm_90 -std=c++17 -Icpp tools/attn_decode_study.cu cpp/backend/cuda/kernels.cu \
//        cpp/core/dtype.cpp -o /tmp/attn_study
//   /tmp/attn_study [--heads Hq Hkv D] [--eager] [BATCHxCTX ...]   (default Qwen3-8B's 32 8 128, a sweep)
// The runtime's switches (QWEN_RT_DECODE_WPR, QWEN_RT_DECODE_FINISH, QWEN_RT_PDL...) apply as in the engine.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.cu"
#include "study_common.cuh"

namespace qrt::cuda {
bool chained_launch_supported() {
  static const bool on = [] {
    const char* e = std::getenv("QWEN_RT_PDL");
    return !(e && std::string(e) == "0");
  }();
  return on;
}
}  // namespace qrt::cuda

using namespace qrt;
using namespace qrt::cuda;

namespace study {

struct Result {
  double us_per_layer, tbps;
  int layers;
};

Result run(int B, int ctx, int Hq, int Hkv, int D, bool eager, int num_sms, int l2_bytes, cudaStream_t st) {
  const int page = 16, pages_per_seq = (ctx + page - 1) / page, P = B * pages_per_seq;
  const int64_t cols = int64_t(Hkv) * D, rows = int64_t(P + 1) * page;  // + the scratch page
  const double kv_bytes = double(B) * ctx * cols * 2 * 2;                 // K and V, bf16
  // Enough layers that the caches together are at least 4x L2 (small caches would otherwise be read from L2),
  // else up to 36 layers for a steadier mean; at most ~24 GB.
  const double layer_bytes = double(rows) * cols * 4;
  const int layers = int(std::max({2.0, std::ceil(4.0 * l2_bytes / layer_bytes),
                                   std::min(36.0, std::floor(24e9 / layer_bytes))}));
  std::vector<__nv_bfloat16*> kc(layers), vc(layers);
  for (int l = 0; l < layers; ++l) {
    kc[l] = dev<__nv_bfloat16>(size_t(rows * cols));
    vc[l] = dev<__nv_bfloat16>(size_t(rows * cols));
    fill(kc[l], size_t(rows * cols), 2 * l + 1);
    fill(vc[l], size_t(rows * cols), 2 * l + 2);
  }
  std::vector<int32_t> perm(P);
  for (int i = 0; i < P; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
  std::vector<int32_t> q_start(B + 1), ctx_len(B, ctx), kv_rows(B), positions(B, ctx - 1);
  for (int s = 0; s <= B; ++s) q_start[s] = s;
  for (int s = 0; s < B; ++s) kv_rows[s] = perm[s * pages_per_seq + (ctx - 1) / page] * page + (ctx - 1) % page;
  AttnBatch b;
  b.num_seqs = b.num_tokens = B;
  b.q_start = upload(q_start);
  b.ctx_len = upload(ctx_len);
  b.page_table = upload(perm);
  b.kv_rows = upload(kv_rows);
  b.max_pages = pages_per_seq;
  b.page_size = page;
  b.max_q_len = 1;
  b.max_ctx_len = ctx;
  const AttnShape sh{Hq, Hkv, D, 1.0f / std::sqrt(float(D))};
  const int64_t qkv_cols = int64_t(Hq + 2 * Hkv) * D;
  Tensor qkv(dev<__nv_bfloat16>(size_t(B * qkv_cols)), DType::BF16, B, qkv_cols);
  fill(qkv.ptr<__nv_bfloat16>(), size_t(B * qkv_cols), 99);
  Tensor out(dev<__nv_bfloat16>(size_t(B) * Hq * D), DType::BF16, B, int64_t(Hq) * D);
  Tensor qn(dev<__nv_bfloat16>(D), DType::BF16, 1, D), kn(dev<__nv_bfloat16>(D), DType::BF16, 1, D);
  fill(qn.ptr<__nv_bfloat16>(), D, 5);
  fill(kn.ptr<__nv_bfloat16>(), D, 6);
  const int max_pos = ctx + 1;
  std::vector<float> tab(size_t(max_pos) * D);
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < D / 2; ++i) {
      const float ang = float(p) * std::pow(1e6f, -2.f * i / D);
      tab[size_t(p) * D + i] = std::cos(ang);
      tab[size_t(p) * D + D / 2 + i] = std::sin(ang);
    }
  const RopeTable rope{upload(tab), D, max_pos};
  const int32_t* pos = upload(positions);
  AttnWorkspace ws;
  ws.bytes = attn_workspace_bytes(b, sh, num_sms);
  ws.partial = ws.bytes ? dev<float>(ws.bytes / 4) : nullptr;
  const QkvFinish fin{&qn, &kn, 1e-6f, false, pos, &rope};
  auto step = [&] {
    for (int l = 0; l < layers; ++l) {
      KvLayer cache{kc[l], vc[l], DType::BF16};
      if (!launch_qkv_attention(qkv, fin, cache, b, sh, out, ws, num_sms, st)) {
        launch_finish_qkv(qkv, sh, &qn, &kn, 1e-6f, false, pos, rope, b, cache, st);
        Tensor q = qkv.col_slice(0, int64_t(Hq) * D);
        launch_attention(q, cache, b, sh, out, ws, num_sms, st);
      }
    }
  };
  ck(cudaDeviceSynchronize(), "setup");
  cudaGraphExec_t exec = nullptr;
  if (!eager) {
    cudaGraph_t g;
    ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
    step();
    ck(cudaStreamEndCapture(st, &g), "end capture");
    ck(cudaGraphInstantiate(&exec, g, 0), "instantiate");
    cudaGraphDestroy(g);
  }
  auto once = [&] {
    if (eager) step();
    else ck(cudaGraphLaunch(exec, st), "replay");
  };
  for (int i = 0; i < 3; ++i) once();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const int reps = 20;
  cudaEventRecord(e0, st);
  for (int i = 0; i < reps; ++i) once();
  cudaEventRecord(e1, st);
  ck(cudaEventSynchronize(e1), "run");
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  const double us = ms * 1e3 / reps / layers;
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  if (exec) cudaGraphExecDestroy(exec);
  for (int l = 0; l < layers; ++l) cudaFree(kc[l]), cudaFree(vc[l]);
  cudaFree(const_cast<int32_t*>(b.q_start));
  cudaFree(const_cast<int32_t*>(b.ctx_len));
  cudaFree(const_cast<int32_t*>(b.page_table));
  cudaFree(const_cast<int32_t*>(b.kv_rows));
  cudaFree(qkv.data), cudaFree(out.data), cudaFree(qn.data), cudaFree(kn.data);
  cudaFree(const_cast<float*>(rope.cos_sin)), cudaFree(const_cast<int32_t*>(pos));
  if (ws.partial) cudaFree(ws.partial);
  return {us, kv_bytes / (us * 1e-6) / 1e12, layers};
}

double copy_tbps(cudaStream_t st) {
  const size_t n = size_t(2) << 30;
  char *a = dev<char>(n), *c = dev<char>(n);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaMemcpyAsync(c, a, n, cudaMemcpyDeviceToDevice, st);
  cudaEventRecord(e0, st);
  for (int i = 0; i < 5; ++i) cudaMemcpyAsync(c, a, n, cudaMemcpyDeviceToDevice, st);
  cudaEventRecord(e1, st);
  ck(cudaEventSynchronize(e1), "copy");
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaFree(a), cudaFree(c);
  return 2.0 * n * 5 / (ms * 1e-3) / 1e12;  // read + write
}

}  // namespace study

using namespace study;

int main(int argc, char** argv) {
  int Hq = 32, Hkv = 8, D = 128;
  bool eager = false;
  std::vector<std::pair<int, int>> cases;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--heads" && i + 3 < argc) {
      Hq = std::atoi(argv[++i]), Hkv = std::atoi(argv[++i]), D = std::atoi(argv[++i]);
    } else if (a == "--eager") {
      eager = true;
    } else {
      const auto x = a.find('x');
      cases.push_back({std::atoi(a.substr(0, x).c_str()), std::atoi(a.substr(x + 1).c_str())});
    }
  }
  if (cases.empty())
    for (int B : {1, 8, 32, 64})
      for (int ctx : {256, 1024, 4096, 16384})
        if (int64_t(B) * ctx <= 262144) cases.push_back({B, ctx});
  int dev_id = 0, num_sms = 0, l2_bytes = 0;
  cudaGetDevice(&dev_id);
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev_id);
  cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, dev_id);
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  std::printf("heads %d/%d x %d, %s, copy %.2f TB/s (read + write)\n", Hq, Hkv, D, eager ? "eager" : "graph",
              copy_tbps(st));
  std::printf("%6s %7s %6s %5s %10s %8s\n", "batch", "ctx", "layers", "wpr", "us/layer", "KV TB/s");
  for (auto [B, ctx] : cases) {
    AttnBatch probe;
    probe.num_tokens = probe.num_seqs = B;
    probe.max_q_len = 1;
    probe.max_ctx_len = ctx;
    const AttnShape sh{Hq, Hkv, D, 1.f};
    const int wpr = decode_warps_per_row(probe, sh, num_sms);
    const Result r = run(B, ctx, Hq, Hkv, D, eager, num_sms, l2_bytes, st);
    std::printf("%6d %7d %6d %5d %10.2f %8.2f   splits %d\n", B, ctx, r.layers, wpr, r.us_per_layer, r.tbps,
                decode_splits(probe, sh, num_sms));
  }
  return 0;
}
