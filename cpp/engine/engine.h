// Engine: owns the ranks (devices, weights, KV), the scheduler and the loop thread.
// Thread-safe: submit/cancel/wait/stats may be called from any thread.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/request.h"
#include "model/config.h"
#include "model/weights.h"

namespace qrt {

struct EngineOptions {
  std::string device = "cpu";      // "cpu" or "cuda"
  int device_index = 0;            // first device (CUDA); rank r uses device_index + r
  std::string weight_dtype = "float32";
  std::string act_dtype = "float32";
  std::string kv_cache_dtype = "auto";  // "auto" (the backend's: CPU fp32 or the 16-bit weights', CUDA the
                                        // activations') or "fp8" (e4m3 with a scale per row and kv head, ops.h KvLayer)
  int max_batch_size = 32;
  int max_model_len = 0;           // 0: config max_position_embeddings, capped by the KV pool
  int max_num_batched_tokens = 2048;
  int page_size = 16;
  int64_t kv_cache_memory = 0;     // bytes per rank; 0: from memory left
  int64_t kv_offload_memory = 0;   // bytes per rank of host memory (pinned) for a second KV tier (kv/tiers.h); 0: none
  double gpu_memory_utilization = 0.9;
  int tensor_parallel_size = 1;
  std::string comm = "auto";       // "auto" (single rank, CPU threads or NCCL by device) or "nccl" (even for one rank)
  bool dummy_weights = false;
  uint64_t seed = 0;
  int num_threads = 0;             // CPU threads in all (0: every core)
  bool cuda_graphs = true;
  double comm_timeout_s = 120.0;
  bool prefix_caching = true;      // requests reuse the cached K/V pages of a prefix they share (scheduler.h)
  int state_snapshots = 16;        // hybrid models: DeltaNet states kept at prompts' page boundaries for prefix hits
  bool check_weights = true;       // refuse checkpoint tensors holding NaN or inf (ValueError naming the tensor)
  // Sparse decode (ops.h SparseAttention), in tokens, rounded up to pages: a decoding sequence longer than the
  // budget attends per kv head to the sink, the recent window and the best-scoring pages within the budget.
  int sparse_budget_tokens = 0;    // 0: off
  int sparse_sink_tokens = 0;
  int sparse_window_tokens = 0;    // at least one page (the current one)
  // Sparse decode with a host tier: device frames that keep the selected host pages (ops.h KvStaging), taken from
  // the device pool. -1: none (QWEN_RT_KV_STAGING=1: twice the budget's pages with both on, fewer where the pool is
  // small) until the staging kernel has been measured on a GPU.
  int kv_staging_pages = -1;
  // Speculative decoding with the checkpoint's MTP head: draft tokens per step (0: off), and the most sequences of a
  // step that feed drafts (more decoding ones than that: the rest decode plainly).
  int speculative_tokens = 0;
  int speculative_max_batch = 8;
  // A request whose drafts' running acceptance (engine.cpp) falls below this decodes plainly for
  // speculative_pause_steps steps, then drafts again: speculation stops costing where it stops paying (long contexts,
  // text the head predicts badly). 0: never pause.
  double speculative_min_acceptance = 0.3;
  int speculative_pause_steps = 16;
  // Benchmarks only: prompts' K/V but the last token's are random stand-ins (the KV cache is filled with random
  // values at start) and hybrid models' states start from zeros; a prompt's first step computes its last token
  // alone. Outputs are those of no real context. Turns prefix caching off. With a host tier, stand-in pages fill
  // the device frames, then host frames (kv/tiers.h).
  bool synthetic_prefill = false;
};

struct EngineStats {
  int free_slots = 0, total_slots = 0, free_pages = 0, total_pages = 0, running = 0, waiting = 0;
  int cached_pages = 0;             // pages no request holds, kept for their prefix (counted in free_pages)
  int64_t preemptions = 0, steps = 0;
  int64_t cached_tokens = 0;        // tokens whose K/V came from the prefix cache instead of a step
  int max_model_len = 0, page_size = 0;
  size_t weight_bytes = 0, kv_bytes = 0;
  size_t state_bytes = 0;           // DeltaNet state of every slot (hybrid models), per rank
  // Sparse decode: rows that selected their pages, and the pages those rows attended to of all they hold (per kv
  // head and layer alike): attended / held is the fraction of the K/V they read.
  int64_t sparse_rows = 0, sparse_pages_attended = 0, sparse_pages_held = 0;
  // Host tier (kv_offload_memory): frames of each tier, pages with K/V in each, bytes moved each way (per rank).
  size_t kv_host_bytes = 0;
  int device_pages = 0, pages_on_device = 0, pages_on_host = 0;
  int64_t kv_bytes_to_host = 0, kv_bytes_to_device = 0;
  // Pages the steps' attention read from device frames and, in place, from host memory (kv/tiers.h PageMoves).
  int64_t page_reads_device = 0, page_reads_host = 0;
  // Staging of selected host pages (kv_staging_pages, summed over ranks): its frames; list entries read from a
  // staging frame, host pages copied into one (misses), entries read in place (no frame left).
  int staging_pages = 0;
  int64_t staging_reads = 0, staging_copies = 0, staging_in_place = 0;
  // Speculation: draft tokens fed, those the samples confirmed, and confirmed by position in the draft.
  int64_t spec_drafted = 0, spec_accepted = 0;
  int64_t spec_pauses = 0;  // times a request's drafting paused (speculative_min_acceptance)
  std::vector<int64_t> spec_accepted_at;
};

class Engine {
 public:
  Engine(const ModelConfig& cfg, const std::vector<TensorSource>& tensors, const EngineOptions& opts,
         const Progress& progress);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request; throws std::invalid_argument for bad input.
  int64_t submit(const std::vector<int32_t>& prompt, const SamplingOptions& opts);
  void cancel(int64_t id);
  // cancel, and nobody will wait for the output: the engine drops it, and the id's channel goes when the request
  // ends (a request whose handle was dropped unfinished). wait on a released id is an error.
  void release(int64_t id);
  // Waits up to timeout_s for new output of request id (until_finished: for its end, so a consumer that
  // wants only the result is not woken for every token) and returns what arrived (possibly nothing).
  // Once the returned output carries a finish reason the id is forgotten. Several threads may wait on one id:
  // each output goes to one of them, and a waiter whose id another took the end of gets std::invalid_argument.
  RequestOutput wait(int64_t id, double timeout_s, bool until_finished = false);
  // Waits up to timeout_s until one of ids has output to take (tokens or its end; an id already forgotten counts)
  // and returns it, or -1. Takes nothing: wait() fetches it.
  int64_t wait_any(const std::vector<int64_t>& ids, double timeout_s);
  EngineStats stats() const;
  // Stops the loop, finishes pending requests as cancelled, frees every device byte. Idempotent.
  // In a fork()ed child of the process that made the engine (its threads are not there, its locks may be held
  // for good) close() leaks it, and every other call throws std::runtime_error saying so.
  void close();

 private:
  struct Impl;
  void check_process() const;
  uint64_t forks_at_birth_;  // fork_count() when made
  std::unique_ptr<Impl> impl_;
};

}  // namespace qrt
