#include "engine/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <pthread.h>
#include <set>
#include <thread>

#include "backend/random.h"
#include "core/error.h"
#include "core/wait.h"
#include "dist/comm.h"
#include "engine/scheduler.h"
#include "kv/kv_cache.h"
#include "model/footprint.h"
#include "model/qwen.h"

namespace qrt {
namespace {

// A thread that runs one job at a time for a rank (its device stays bound to this thread).
class RankWorker {
 public:
  RankWorker() : th_([this] { loop(); }) {}
  ~RankWorker() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    th_.join();
  }
  void post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lk(m_);
    job_ = std::move(fn);
    done_ = false;
    error_ = nullptr;
    cv_.notify_all();
  }
  // Waits for the job (timeout_s >= kNoLimitSeconds: without a limit); throws its exception, or after timeout_s
  // (the job still runs).
  void wait(double timeout_s) {
    std::unique_lock<std::mutex> lk(m_);
    QRT_CHECK(wait_seconds(cv_, lk, timeout_s, [&] { return done_; }),
              "a tensor-parallel rank did not finish its work within ", timeout_s, " s");
    if (error_) std::rethrow_exception(error_);
  }
  bool done() {
    std::lock_guard<std::mutex> lk(m_);
    return done_;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lk(m_);
    while (true) {
      cv_.wait(lk, [&] { return stop_ || job_; });
      if (stop_) return;
      auto fn = std::move(job_);
      job_ = nullptr;
      lk.unlock();
      std::exception_ptr err;
      try {
        fn();
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      error_ = err;
      done_ = true;
      cv_.notify_all();
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool done_ = true, stop_ = false;
  std::exception_ptr error_;
  std::thread th_;
};

struct Rank {
  std::unique_ptr<Backend> be;
  std::unique_ptr<Comm> comm;
  std::unique_ptr<QwenModel> model;
  std::unique_ptr<StateCache> state;  // models with DeltaNet layers
  std::unique_ptr<KvCache> kv;
};


// Built at load: the loop may fail for want of memory to build a message.
const std::string kUnknownFailure = "engine step failed: an unknown error (or no memory left to describe it)";

const std::string kNonFiniteLogits =
    "non-finite logits (NaN or inf) for this request: its activations overflowed, or the weights hold NaN/inf "
    "(refused at load unless check_weights=False)";

// Test hook: QWEN_RT_TEST_FAIL_RANK=<r> makes every step of rank r fail before its forward (a failing rank's
// stand-in, while the others wait in its collectives).
void test_fail_rank(int r) {
  static const int rank = [] {
    const char* e = std::getenv("QWEN_RT_TEST_FAIL_RANK");
    return e && *e ? std::atoi(e) : -1;
  }();
  QRT_CHECK(r != rank, "rank ", r, " failed (QWEN_RT_TEST_FAIL_RANK)");
}

// fork()s this process made a child in: 0 in the process that loaded the library, more in a child.
std::atomic<uint64_t> forks{0};
uint64_t fork_count() {
  static const bool registered = pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1); }) == 0;
  (void)registered;
  return forks.load();
}

// Host memory available (bytes): /proc/meminfo's MemAvailable, or infinity where it cannot be read.
double host_memory_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return INFINITY;
  char line[256];
  double kb = -1;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
  std::fclose(f);
  return kb >= 0 ? kb * 1024 : INFINITY;
}

// The sparse decode options in pages (rounded up), checked.
SparseAttention sparse_rule(const EngineOptions& o) {
  SparseAttention r;
  QRT_CHECK_ARG(o.sparse_budget_tokens >= 0 && o.sparse_sink_tokens >= 0 && o.sparse_window_tokens >= 0,
                "sparse attention: budget, sink and window tokens must be >= 0");
  if (o.sparse_budget_tokens == 0) return r;
  const int ps = o.page_size;
  auto pages = [ps](int tokens) { return int((int64_t(tokens) + ps - 1) / ps); };
  r.budget_pages = pages(o.sparse_budget_tokens);
  r.sink_pages = pages(o.sparse_sink_tokens);
  r.window_pages = std::max(1, pages(o.sparse_window_tokens));
  QRT_CHECK_ARG(r.sink_pages + r.window_pages < r.budget_pages, "sparse attention: the budget (",
                r.budget_pages, " pages of ", ps, " tokens) must exceed sink + window (", r.sink_pages, " + ",
                r.window_pages, " pages), leaving pages to select");
  return r;
}

}  // namespace

struct Engine::Impl {
  ModelConfig cfg;
  EngineOptions opt;
  SparseAttention sparse;  // opt's sparse decode in pages
  std::vector<Rank> ranks;
  std::vector<std::unique_ptr<RankWorker>> workers;  // workers[r - 1] drives rank r (rank 0: the caller)
  std::unique_ptr<Scheduler> sched;
  std::unique_ptr<TierMap> tiers;  // with a host tier (kv_offload_memory)
  int staging_pages = 0;           // ops.h KvStaging frames (each rank's KvCache)
  size_t host_page_bytes = 0;      // a page's K/V rows in the host tier (per rank)
  // State models with speculation: the states verification keeps to roll back to (StateCache, after the snapshots).
  int kept_states() const { return opt.speculative_tokens * opt.speculative_max_batch; }
  // Rows of a step that sample: one per sequence, and one per draft token.
  int logit_rows() const { return opt.max_batch_size + opt.speculative_tokens * opt.speculative_max_batch; }
  // The most pages one step writes: its tokens' pages, and two more per sequence (one that starts inside a page and
  // ends inside another).
  int64_t step_pages() const {
    return (int64_t(opt.max_num_batched_tokens) + opt.page_size - 1) / opt.page_size + 2 * int64_t(opt.max_batch_size);
  }

  mutable std::mutex mu;
  std::condition_variable work_cv, out_cv;
  std::deque<std::unique_ptr<Request>> incoming;
  std::vector<int64_t> cancels;
  std::map<int64_t, RequestOutput> channels;  // pending output of live requests
  std::set<int64_t> released;                  // ids whose output nobody takes: no channel, dropped at the end
  bool stop = false, closed = false;
  std::string failed;
  int64_t next_id = 1;
  EngineStats snapshot;
  std::thread loop_thread;

  // Runs fn on every rank at once (rank 0 on this thread) and waits for all; a rank that takes longer than
  // timeout_s (default comm_timeout_s: a step's bound) is an error. A rank whose job throws aborts its
  // communicator at once, so that no other rank waits out the bound in a collective; the error thrown is the
  // first in time (the cause, not the aborted collectives it led to).
  static constexpr double kNoLimit = std::numeric_limits<double>::infinity();
  void on_ranks(const std::function<void(int, Rank&)>& fn, double timeout_s = -1) {
    if (timeout_s < 0) timeout_s = opt.comm_timeout_s;
    std::mutex first_mu;
    std::exception_ptr first;  // the first job's failure, in time
    auto job = [&](int r) {
      try {
        fn(r, ranks[r]);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lk(first_mu);
          if (!first) first = std::current_exception();
        }
        if (ranks.size() > 1) abort_collectives(ranks[r]);
        throw;
      }
    };
    for (size_t r = 1; r < ranks.size(); ++r) workers[r - 1]->post([&job, r] { job(int(r)); });
    try {
      job(0);
    } catch (...) {
    }
    bool late = false;
    for (size_t r = 1; r < ranks.size(); ++r) {
      try {
        workers[r - 1]->wait(timeout_s);
      } catch (...) {
        std::lock_guard<std::mutex> lk(first_mu);
        if (!workers[r - 1]->done()) {  // the timeout: the job still runs (its own error, if any, is in `first`)
          late = true;
          if (!first) first = std::current_exception();  // before the aborts below make the job throw too
        }
      }
    }
    if (late) {
      // A rank outlived the timeout, and its job refers to this frame: end the collectives it may wait in, and
      // return only once every job is over. This thread's rank drops its graphs first (NCCL's teardown waits for
      // graphs that captured its collectives); a late rank's are its own thread's to drop.
      abort_collectives(ranks[0]);
      for (auto& rk : ranks)
        if (rk.comm) rk.comm->abort();
      for (auto& w : workers) {
        try {
          w->wait(kNoLimit);
        } catch (...) {  // recorded in `first` already
        }
      }
    }
    std::lock_guard<std::mutex> lk(first_mu);
    if (first) std::rethrow_exception(first);
  }
  // Ends a failed rank's collectives: its graphs go first, as NCCL's teardown waits for those that captured them.
  static void abort_collectives(Rank& rk) noexcept {
    try {
      if (rk.be) rk.be->drop_graphs();
      if (rk.comm) rk.comm->abort();
    } catch (...) {
    }
  }

  // A launched step whose tokens are not yet known (at most one: `launched`), and the requests that
  // finished while it was in flight (kept alive because it refers to them).
  struct Flight {
    Plan plan;
    bool sampled = false;        // a sampling was started
    bool needs_tokens = false;   // a request of it samples with penalties: the next plan needs its tokens
    std::vector<std::unique_ptr<Request>> retired;
  };
  std::unique_ptr<Flight> launched;
  Flight* completing = nullptr;  // the step complete() works on (it keeps the requests that end meanwhile)

  void build(const std::vector<TensorSource>& tensors, const Progress& progress);
  // Before anything is allocated: refuses a model the devices cannot hold (ValueError stating both numbers), and
  // caps a default max_model_len at the tokens the KV pool could ever hold (the RoPE table and page tables are
  // sized by it).
  void fit_memory(bool default_len, DType wdt, DType adt, DType kvdt);
  void release_ranks() noexcept;  // frees every rank's device memory, then the rank threads
  void loop();
  void step();
  std::unique_ptr<Flight> launch(Plan plan);
  void complete(std::unique_ptr<Flight> f);
  void publish_token(Request& r, const SampleResult& res, int row);
  // The sampling parameters of q's next token, or (ahead > 0) of the one `ahead` tokens after it (speculation).
  SampleRow sample_row(const Request& q, int ahead, bool& needs_tokens) const;
  // Speculation, after plan's step: the MTP head's passes give each running request of it that decodes next its
  // draft (Request::draft); the first pass also writes the MTP layer's K/V of every position the step confirmed.
  void draft(const Plan& plan);
  // With a host tier: in's pages as frames (TierMap::prepare) and the moves that give its written pages device frames,
  // counted in the stats.
  PageMoves to_frames(StepInput& in);
  // The request's end in its channel (under mu).
  void end_channel(const Request& r, Finish f, const std::string& error = "");
  // A request out of the scheduler, kept until the step in flight is done (loop thread, or the loop stopped).
  void retire(std::unique_ptr<Request> r);
  // end_channel, then retire.
  void finish(std::unique_ptr<Request> r, Finish f, const std::string& error = "");
  void fail_all(const std::string& msg) noexcept;
  void update_snapshot();
};

namespace {

// Runs fn on a thread of its own and returns (or throws) what it did. Rank 0's device work in build and close
// runs there, so the calling thread's current CUDA device stays what the application (torch) made it.
void on_own_thread(const std::function<void()>& fn) {
  std::exception_ptr err;
  std::thread t([&] {
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
  });
  t.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace

void Engine::Impl::build(const std::vector<TensorSource>& tensors, const Progress& progress) {
  const int n = opt.tensor_parallel_size;
  QRT_CHECK_ARG(n >= 1, "tensor_parallel_size must be >= 1");
  QRT_CHECK_ARG(opt.max_batch_size >= 1, "max_batch_size must be >= 1");
  QRT_CHECK_ARG(opt.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1");
  QRT_CHECK_ARG(opt.page_size >= 1 && (opt.page_size & (opt.page_size - 1)) == 0,
                "page_size must be a power of two");
  QRT_CHECK_ARG(opt.state_snapshots >= 0, "state_snapshots must be >= 0");
  QRT_CHECK_ARG(opt.kv_offload_memory >= 0, "kv_offload_memory must be >= 0 bytes");
  QRT_CHECK_ARG(opt.speculative_tokens >= 0 && opt.speculative_tokens <= 8, "speculative_tokens must be in [0, 8], got ",
                opt.speculative_tokens);
  QRT_CHECK_ARG(opt.speculative_max_batch >= 1, "speculative_max_batch must be >= 1");
  QRT_CHECK_ARG(opt.speculative_min_acceptance >= 0 && opt.speculative_min_acceptance <= 1,
                "speculative_min_acceptance must be in [0, 1], got ", opt.speculative_min_acceptance);
  QRT_CHECK_ARG(opt.speculative_pause_steps >= 0, "speculative_pause_steps must be >= 0");
  opt.speculative_max_batch = std::min(opt.speculative_max_batch, opt.max_batch_size);
  if (opt.speculative_tokens == 0) {
    cfg.mtp_layers = 0;  // the head is loaded for speculation only
  } else {
    QRT_CHECK_ARG(cfg.mtp_layers > 0, "speculative_tokens needs the checkpoint's multi-token-prediction head (mtp.*); ",
                  "this model has none (config.json: mtp_num_hidden_layers)");
  }
  if (opt.synthetic_prefill) opt.prefix_caching = false;  // stand-in K/V are no prefix's
  if (!opt.prefix_caching) opt.state_snapshots = 0;  // snapshots serve prefix hits only
  sparse = sparse_rule(opt);
  const bool default_len = opt.max_model_len <= 0;
  if (default_len) opt.max_model_len = cfg.max_position_embeddings;
  QRT_CHECK_ARG(opt.max_model_len <= cfg.max_position_embeddings, "max_model_len ", opt.max_model_len,
                " exceeds the model's max_position_embeddings ", cfg.max_position_embeddings);
  const bool cuda = opt.device == "cuda";
  QRT_CHECK_ARG(cuda || opt.device == "cpu", "unknown device '", opt.device, "'");
  if (cuda) {
    // A step's sequences and a chunk's tokens index CUDA grid dimensions that hold at most 65535 blocks.
    QRT_CHECK_ARG(opt.max_batch_size <= 65535, "max_batch_size must be <= 65535 on CUDA, got ", opt.max_batch_size);
    QRT_CHECK_ARG(opt.max_num_batched_tokens <= 65535, "max_num_batched_tokens must be <= 65535 on CUDA, got ",
                  opt.max_num_batched_tokens);
    const int count = cuda_device_count();
    QRT_CHECK_ARG(count > 0, "no CUDA device is usable: ", cuda_unavailable_reason());
    QRT_CHECK_ARG(opt.device_index >= 0 && opt.device_index + n <= count, "cuda:", opt.device_index, " with ",
                  "tensor_parallel_size ", n, " needs ", opt.device_index + n, " devices, ", count, " present");
  }
  const DType wdt = parse_dtype(opt.weight_dtype), adt = parse_dtype(opt.act_dtype);
  // Mapped while the ranks load their shards (every upload copies out of them), unmapped when build returns.
  std::unique_ptr<WeightFiles> files;
  if (!opt.dummy_weights) {
    files = std::make_unique<WeightFiles>(tensors, opt.check_weights);
    // Every tensor, before any is read or anything allocated.
    for_each_checkpoint_tensor(cfg, [&](const CheckpointTensor& t) {
      if (t.linear) check_linear(*files, cfg, t.name.substr(0, t.name.size() - 7), t.rows, t.cols);  // less ".weight"
      else files->check(t.name, t.rows, t.cols);
    });
  }

  ranks.resize(n);
  for (int r = 1; r < n; ++r) workers.push_back(std::make_unique<RankWorker>());
  // Backends, each created on its rank's thread.
  const int cores = opt.num_threads > 0 ? opt.num_threads : cpu_cores();
  // The CPU keeps 16-bit weights' K/V in their dtype (as transformers does), others in fp32.
  const DType cpu_kv = wdt == DType::BF16 || wdt == DType::F16 ? wdt : DType::F32;
  // Loading takes as long as it takes (comm_timeout_s bounds steps).
  on_ranks([&](int r, Rank& rk) {
    rk.be = cuda ? make_cuda_backend(opt.device_index + r, adt) : make_cpu_backend(std::max(1, cores / n), cpu_kv);
  }, kNoLimit);
  QRT_CHECK_ARG(opt.kv_cache_dtype == "auto" || opt.kv_cache_dtype == "fp8", "kv_cache_dtype must be 'auto' or ",
                "'fp8', got '", opt.kv_cache_dtype, "'");
  const DType kvdt = opt.kv_cache_dtype == "fp8" ? DType::F8E4M3 : ranks[0].be->kv_dtype();
  fit_memory(default_len, wdt, adt, kvdt);
  // Communicators.
  QRT_CHECK_ARG(opt.comm == "auto" || (opt.comm == "nccl" && cuda), "comm must be 'auto', or 'nccl' on CUDA, got '",
                opt.comm, "'");
  if (n == 1 && opt.comm != "nccl") {
    ranks[0].comm = make_single_comm();
  } else if (!cuda) {
    auto group = make_thread_group(n, opt.comm_timeout_s);
    for (int r = 0; r < n; ++r) ranks[r].comm = make_thread_comm(group, r);
  } else {
    char id[128];
    nccl_unique_id(id);
    on_ranks([&](int r, Rank& rk) { rk.comm = make_nccl_comm(*rk.be, id, r, n); }, kNoLimit);
  }
  // Models: every rank loads its shard at once.
  Limits lim;
  lim.max_tokens = opt.max_num_batched_tokens;
  lim.max_seqs = opt.max_batch_size;
  lim.max_pages_per_seq = (opt.max_model_len + opt.page_size - 1) / opt.page_size;
  lim.max_positions = opt.max_model_len;
  lim.graphs = opt.cuda_graphs;
  lim.sparse = sparse;
  lim.max_logit_rows = logit_rows();
  on_ranks([&](int r, Rank& rk) {
    WeightSpec ws{files.get(), opt.seed, wdt};
    rk.model = std::make_unique<QwenModel>(cfg, *rk.be, *rk.comm, ws, lim, r == 0 ? progress : Progress());
  }, kNoLimit);
  // Rank 0 samples: its scratch for a full batch is taken before the pool is sized.
  ranks[0].be->reserve_sampling(logit_rows(), cfg.vocab_size);
  // DeltaNet state, one per slot (and the scratch slot), before the KV pool takes what memory is left.
  const int delta_layers = cfg.num_delta_net_layers();
  size_t state_bytes = 0;
  if (delta_layers > 0) {
    on_ranks([&](int, Rank& rk) {
      rk.state = std::make_unique<StateCache>(*rk.be, delta_layers, opt.max_batch_size, opt.state_snapshots, kept_states(),
                                              rk.model->delta_net_shape(), rk.be->act_dtype());
      rk.be->synchronize();
    }, kNoLimit);
    const Rank& r0 = ranks[0];
    state_bytes = StateCache::bytes_per_slot(delta_layers, r0.model->delta_net_shape(), r0.be->act_dtype()) *
                  size_t(opt.max_batch_size + 1 + opt.state_snapshots + kept_states());
  }
  // KV pool: the same number of pages on every rank.
  KvFormat kvf;
  kvf.layers = cfg.num_kv_layers();
  kvf.page_size = opt.page_size;
  kvf.kv_heads = ranks[0].model->kv_cols() / std::max(1, cfg.head_dim);
  kvf.head_dim = cfg.head_dim;
  kvf.dtype = kvdt;
  kvf.summaries = lim.sparse.budget_pages > 0;
  kvf.summary_dtype = KvFormat::summary_dtype_for(kvdt, ranks[0].be->act_dtype());
  const size_t bpp = kvf.page_bytes();
  // Memory free now on the rank with the least (CPU ranks share one memory).
  size_t free_b = SIZE_MAX;
  const Backend* least = nullptr;
  for (auto& rk : ranks) {
    size_t fr = 0, total = 0;
    rk.be->memory_info(&fr, &total);
    if (fr < free_b) free_b = fr, least = rk.be.get();
  }
  int64_t pages = 0;
  if (bpp == 0) {  // no attention layer: pages hold no K/V, only the scheduler's bookkeeping
    pages = int64_t(opt.max_batch_size) * lim.max_pages_per_seq;
  } else if (opt.kv_cache_memory > 0) {
    pages = opt.kv_cache_memory / int64_t(bpp);
    // The pool is committed as it fills: refuse what the device cannot hold now.
    const size_t need = size_t(opt.kv_cache_memory) * (cuda ? 1 : n);
    QRT_CHECK_ARG(need <= free_b, "kv_cache_memory (", opt.kv_cache_memory, " bytes per rank) exceeds the memory ",
                  "available on ", least->name(), " (", free_b, " bytes)");
  } else {
    const double share = cuda ? opt.gpu_memory_utilization * double(free_b) : 0.25 * double(free_b) / n;
    // Never more than every slot at full length needs.
    const int64_t want = int64_t(opt.max_batch_size) * lim.max_pages_per_seq;
    pages = std::min<int64_t>(int64_t(share / double(bpp)), want);
  }
  if (opt.kv_offload_memory > 0) {
    const double avail = host_memory_available() - (cuda ? 0.0 : double(pages) * double(bpp) * n);
    QRT_CHECK_ARG(double(opt.kv_offload_memory) * n <= 0.9 * avail, "kv_offload_memory (", opt.kv_offload_memory,
                  " bytes per rank", n > 1 ? str_cat(", ", n, " ranks") : std::string(), ") exceeds 90% of the host ",
                  "memory available (", int64_t(std::max(avail, 0.0)), " bytes)");
  }
  // Host tier: its frames' summary rows are on the device, taken from its pages; the pool holds `reserve` pages
  // fewer than the tiers' frames, so a step's pages always find device frames (kv/tiers.h).
  int64_t host_pages = 0, logical = pages;
  if (opt.kv_offload_memory > 0) {
    QRT_CHECK_ARG(bpp > 0, "kv_offload_memory: this model has no attention layer (no K/V to offload)");
    host_pages = opt.kv_offload_memory / int64_t(kvf.host_page_bytes());
    QRT_CHECK_ARG(host_pages >= 1, "kv_offload_memory (", opt.kv_offload_memory, " bytes) holds no page: one needs ",
                  kvf.host_page_bytes(), " bytes per rank");
    const int64_t sbpp = int64_t(kvf.summary_page_bytes());
    pages -= (host_pages * sbpp + int64_t(bpp) - 1) / int64_t(bpp);
    const int64_t reserve = step_pages();
    QRT_CHECK_ARG(pages >= reserve, "kv_offload_memory: the device KV pool (", std::max<int64_t>(pages, 0),
                  " pages) must hold the pages one step writes (", reserve, ": max_num_batched_tokens / page_size + ",
                  "2 x max_batch_size); raise kv_cache_memory or lower max_num_batched_tokens or max_batch_size");
    logical = pages + host_pages - reserve;
    // Staging frames and their map, out of the device pool (the map's bytes rounded up to pages, and 256 more for
    // KvCache's alignment).
    auto take = [&](int64_t slots) {
      const int64_t meta = int64_t(KvCache::staging_bytes(kvf, int(host_pages), int(slots))) + 256;
      return slots + (meta + int64_t(bpp) - 1) / int64_t(bpp);
    };
    // The default: none until the staging kernel has been measured on a GPU (on the CPU both tiers are host memory:
    // staging would only copy). QWEN_RT_KV_STAGING=1 sizes it: twice the budget's pages, no more than the host
    // tier's, and leaving the pool three quarters of what it has beyond a step's pages (none where that leaves none).
    int64_t slots = opt.kv_staging_pages;
    if (slots < 0) {
      const char* e = std::getenv("QWEN_RT_KV_STAGING");
      const bool on = e && std::strcmp(e, "1") == 0 && sparse.budget_pages > 0;
      slots = on ? std::min<int64_t>(2 * sparse.budget_pages, host_pages) : 0;
      while (slots > 0 && take(slots) > (pages - reserve) / 4) slots /= 2;
    }
    if (slots > 0) {
      QRT_CHECK_ARG(sparse.budget_pages > 0, "kv_staging_pages needs sparse attention (it keeps selected host pages)");
      const int64_t taken = take(slots);
      QRT_CHECK_ARG(pages - taken >= reserve, "kv_staging_pages: ", slots, " staging frames leave the device KV pool ",
                    std::max<int64_t>(pages - taken, 0), " pages, fewer than one step writes (", reserve,
                    "); raise kv_cache_memory or lower kv_staging_pages");
      pages -= taken;
      logical -= taken;
    }
    staging_pages = int(slots);
  }
  QRT_CHECK_ARG(opt.kv_staging_pages <= 0 || host_pages > 0,
                "kv_staging_pages needs a host tier (kv_offload_memory): it keeps selected host pages");
  QRT_CHECK_ARG(pages >= 1, "the KV cache has room for no page: one page needs ", bpp, " bytes per rank");
  // Frame numbers (device, scratch, staging, host) times page_size fit the int32 rows of a step.
  QRT_CHECK_ARG(pages + 1 + staging_pages + host_pages < (int64_t(1) << 31) / opt.page_size - 1, "too many KV pages");
  on_ranks([&](int, Rank& rk) {
    rk.kv = std::make_unique<KvCache>(*rk.be, kvf, int(pages), int(host_pages), staging_pages);
    if (opt.synthetic_prefill) rk.kv->fill_random(opt.seed ^ 0x5717e71cull);
    rk.be->synchronize();
  }, kNoLimit);
  if (host_pages > 0)
    tiers = std::make_unique<TierMap>(int(pages), int(host_pages), int(logical), opt.synthetic_prefill,
                                      staging_pages);
  // A default max_model_len is capped by the pool, which holds every token of a request but its last: a longer
  // request could never run. (One the caller set stays; such a request is refused at submit.)
  if (default_len) opt.max_model_len = int(std::min<int64_t>(opt.max_model_len, logical * opt.page_size + 1));
  SchedulerOptions so;
  so.max_batch_size = opt.max_batch_size;
  so.max_num_batched_tokens = opt.max_num_batched_tokens;
  so.page_size = opt.page_size;
  so.num_pages = int(logical);
  so.max_model_len = opt.max_model_len;
  so.prefix_caching = opt.prefix_caching;
  so.has_state = delta_layers > 0;
  so.state_snapshots = opt.state_snapshots;
  so.speculative_tokens = opt.speculative_tokens;
  so.speculative_max_batch = opt.speculative_max_batch;
  so.kept_slot0 = opt.max_batch_size + 1 + opt.state_snapshots;
  so.synthetic_prefill = opt.synthetic_prefill;
  sched = std::make_unique<Scheduler>(so);
  if (tiers) sched->pool().track_drops();
  snapshot.weight_bytes = ranks[0].model->weight_bytes();
  snapshot.kv_bytes = bpp * size_t(pages);
  host_page_bytes = kvf.host_page_bytes();
  snapshot.kv_host_bytes = host_page_bytes * size_t(host_pages);
  snapshot.device_pages = int(pages);
  snapshot.staging_pages = staging_pages;
  snapshot.state_bytes = state_bytes;
  update_snapshot();
}

void Engine::Impl::fit_memory(bool default_len, DType wdt, DType adt, DType kvdt) {
  const int n = opt.tensor_parallel_size;
  const bool cuda = opt.device == "cuda";
  FootprintShape sh;
  sh.ranks = n;
  sh.weights = wdt;
  sh.act = adt;
  sh.kv = kvdt;
  sh.folds_gains = ranks[0].be->folds_norm_gains();
  sh.max_tokens = opt.max_num_batched_tokens;
  sh.max_seqs = opt.max_batch_size;
  sh.page_size = opt.page_size;
  sh.max_pages_per_seq = 0;  // the page table is counted per position below
  sh.sparse = sparse.budget_pages > 0;
  sh.max_logit_rows = logit_rows();
  const Footprint f = footprint(cfg, sh);
  const double sampling = cuda ? double(logit_rows()) * cfg.vocab_size * 4 : 0;  // reserve_sampling
  // Every slot's state, the scratch slot's and the snapshots'.
  const double state = double(opt.max_batch_size + 1 + opt.state_snapshots + kept_states()) * f.state_slot;
  const double fixed = f.weights + f.workspace + sampling + state;
  const double per_position =
      f.rope_position + (double(opt.max_batch_size) * 4 + f.select_page) / opt.page_size;
  // Memory free now on the rank with the least; CPU ranks share one memory.
  double free_b = INFINITY;
  std::string where;
  for (auto& rk : ranks) {
    size_t fr = 0, total = 0;
    rk.be->memory_info(&fr, &total);
    if (double(fr) < free_b) free_b = double(fr), where = rk.be->name();
  }
  const double sharing = cuda ? 1 : n;  // ranks whose needs come out of that memory
  const double positions = default_len ? 2 : opt.max_model_len;
  const double need = fixed + positions * per_position + 2 * f.kv_page;  // one page and the scratch page
  QRT_CHECK_ARG(need * sharing <= free_b, "the model needs at least ", int64_t(need), " bytes per rank",
                n > 1 && !cuda ? str_cat(" (", n, " ranks share it)") : std::string(), ": weights ",
                int64_t(f.weights), ", workspace ", int64_t(f.workspace + sampling),
                state > 0 ? str_cat(", DeltaNet state ", int64_t(state)) : std::string(), ", RoPE table ",
                int64_t(positions * per_position), ", KV cache of one page ", int64_t(2 * f.kv_page), "; ", where,
                " has ", int64_t(free_b), " bytes available");
  if (!default_len) return;
  // The most pages the pool could take (build sizes it from what is left after loading: fewer).
  double pages = opt.kv_cache_memory > 0 ? double(opt.kv_cache_memory) / f.kv_page
                                         : (cuda ? opt.gpu_memory_utilization : 0.25 / n) * free_b / f.kv_page;
  if (opt.kv_offload_memory > 0 && f.kv_host_page > 0) pages += double(opt.kv_offload_memory) / f.kv_host_page;
  opt.max_model_len = int(std::min<double>(opt.max_model_len, std::floor(pages) * opt.page_size + 1));
  opt.max_model_len = std::max(opt.max_model_len, 2);
}

void Engine::Impl::update_snapshot() {
  snapshot.free_slots = sched->free_slots();
  snapshot.total_slots = opt.max_batch_size;
  snapshot.free_pages = sched->free_pages();
  snapshot.total_pages = sched->total_pages();
  snapshot.running = sched->running();
  snapshot.waiting = sched->waiting() + int(incoming.size());
  snapshot.preemptions = sched->preemptions();
  snapshot.cached_pages = sched->cached_pages();
  snapshot.cached_tokens = sched->cached_tokens();
  snapshot.max_model_len = opt.max_model_len;
  snapshot.page_size = opt.page_size;
  if (staging_pages > 0) {
    std::array<int64_t, 3> c{0, 0, 0};
    for (const Rank& rk : ranks)
      if (rk.kv) {
        const std::array<int64_t, 3> r = rk.kv->staging_counts();
        for (size_t j = 0; j < 3; ++j) c[j] += r[j];
      }
    snapshot.staging_reads = c[0], snapshot.staging_copies = c[1], snapshot.staging_in_place = c[2];
  }
}

void Engine::Impl::publish_token(Request& r, const SampleResult& res, int row) {
  if (released.count(r.id)) return;
  RequestOutput& o = channels[r.id];
  o.cached_tokens = r.cached;
  o.tokens.push_back(res.tokens[row]);
  o.logprobs.push_back(res.logprobs[row]);
  o.top_n = r.opts.logprobs;
  for (int i = 0; i < r.opts.logprobs; ++i) {
    o.top_ids.push_back(res.top_ids[size_t(row) * res.max_n + i]);
    o.top_logprobs.push_back(res.top_logprobs[size_t(row) * res.max_n + i]);
  }
}

void Engine::Impl::end_channel(const Request& r, Finish f, const std::string& error) {
  if (released.erase(r.id)) return;
  RequestOutput& o = channels[r.id];
  o.cached_tokens = r.cached;
  o.finish = f;
  o.error = error;
  o.top_n = r.opts.logprobs;
}

void Engine::Impl::retire(std::unique_ptr<Request> r) {
  r->finished = true;
  // The step in flight may refer to it; so may the one being completed (its drafts are made after its requests end).
  Flight* keep = launched ? launched.get() : completing;
  if (keep) keep->retired.push_back(std::move(r));
}

void Engine::Impl::finish(std::unique_ptr<Request> r, Finish f, const std::string& error) {
  end_channel(*r, f, error);
  retire(std::move(r));
}

void Engine::Impl::fail_all(const std::string& msg) noexcept {
  std::lock_guard<std::mutex> lk(mu);
  try {
    failed = msg;
    // Every channel ends before any page is freed: should the scheduler's state be what failed (a release that
    // throws), no waiter is left without its end.
    const std::vector<Request*> all = sched->all_requests();
    for (Request* r : all) end_channel(*r, Finish::Error, msg);
    while (!incoming.empty()) {
      finish(std::move(incoming.front()), Finish::Error, msg);
      incoming.pop_front();
    }
    for (Request* r : all) retire(sched->remove(r));
    update_snapshot();
  } catch (...) {  // the engine is failed already; its requests' ends are what matters
  }
  out_cv.notify_all();
}

void Engine::Impl::loop() {
  // Whatever throws here (a step, or the scheduler while taking requests in) fails every request and ends the
  // loop; nothing leaves the thread.
  std::string error;
  try {
    while (true) {
      std::vector<int64_t> cancelled;
      {
        std::unique_lock<std::mutex> lk(mu);
        work_cv.wait(lk, [&] { return stop || !incoming.empty() || !cancels.empty() || !sched->idle(); });
        if (stop) return;
        while (!incoming.empty()) {
          sched->add(std::move(incoming.front()));
          incoming.pop_front();
        }
        cancelled.swap(cancels);
        if (!cancelled.empty()) {
          for (Request* r : sched->all_requests())
            if (std::find(cancelled.begin(), cancelled.end(), r->id) != cancelled.end())
              finish(sched->remove(r), Finish::Cancelled);
          update_snapshot();
          out_cv.notify_all();
        }
      }
      step();
    }
  } catch (const std::exception& e) {
    try {
      error = std::string("engine step failed: ") + e.what();
    } catch (...) {  // no memory for the message: the fixed one below
    }
  } catch (...) {
  }
  // A rank or the device may still wait in a collective: end those waits before anything else. No rank's job runs
  // now (on_ranks returns only when all are over); graphs go first, as NCCL's teardown waits for those that
  // captured its collectives.
  for (auto& rk : ranks) abort_collectives(rk);
  fail_all(error.empty() ? kUnknownFailure : error);
}

// One turn of the loop. With one rank, the next step is planned and launched while the step before it
// still runs on the device (its sampled tokens feed the new step in device memory, StepInput::token_src);
// only then are the earlier step's results taken. With several ranks, or when the plan needs the tokens
// themselves (penalties), the step before is completed first.
void Engine::Impl::step() {
  static const bool overlap = [] {  // QWEN_RT_OVERLAP=0: always complete a step before planning the next
    const char* e = std::getenv("QWEN_RT_OVERLAP");
    return !(e && std::string(e) == "0");
  }();
  // Speculation drafts from the step's tokens before the next is planned.
  if (launched && (ranks.size() > 1 || launched->needs_tokens || !overlap || opt.speculative_tokens > 0))
    complete(std::move(launched));
  Plan plan = sched->plan();
  std::unique_ptr<Flight> before = std::move(launched);
  if (!plan.empty()) launched = launch(std::move(plan));
  if (before) complete(std::move(before));
}

std::unique_ptr<Engine::Impl::Flight> Engine::Impl::launch(Plan plan) {
  auto f = std::make_unique<Flight>();
  f->plan = std::move(plan);
  const Plan& p = f->plan;
  const int32_t* sampled = ranks[0].be->sampled_tokens();
  // With a host tier: the step's pages as frames, and the frames' moves that give its written pages device frames.
  StepInput framed;
  PageMoves moves;
  if (tiers) {
    framed = p.input;
    moves = to_frames(framed);
  }
  const StepInput& input = tiers ? framed : p.input;
  Tensor logits;
  on_ranks([&](int r, Rank& rk) {
    test_fail_rank(r);
    if (tiers) rk.kv->move(moves);
    // State models: a prefix hit's slot resumes from its snapshot; a prompt's state is snapshotted where its
    // chunk ended at a snapshot boundary (stream-ordered around the step).
    for (const auto& s : p.seqs) {
      if (s.restore >= 0) rk.state->copy_slot(rk.state->snapshot_slot(s.restore), s.req->slot);
      if (s.zero_state) rk.state->zero_slot(s.req->slot);
    }
    Tensor l = rk.model->forward(input, *rk.kv, rk.state.get(), r == 0 ? sampled : nullptr);
    for (const auto& s : p.seqs)
      if (s.snapshot >= 0) rk.state->copy_slot(s.req->slot, rk.state->snapshot_slot(s.snapshot));
    if (r == 0) logits = l;
  });
  if (sparse.budget_pages > 0) {
    std::lock_guard<std::mutex> lk(mu);
    for (const auto& s : p.seqs) {
      const int ctx = s.first + s.count;
      if (!sparse.selects(ctx, s.count, opt.page_size)) continue;
      snapshot.sparse_rows++;
      snapshot.sparse_pages_attended += sparse.budget_pages;
      snapshot.sparse_pages_held += (ctx + opt.page_size - 1) / opt.page_size;
    }
  }
  // Sampling parameters of the sequences that reached their end: a row each, and one per draft token (the draws of
  // the tokens after it: each row samples the token the request would sample there without speculation).
  std::vector<SampleRow> rows;
  for (const auto& s : p.seqs) {
    for (int i = 0; i < s.rows(); ++i) rows.push_back(sample_row(*s.req, i, f->needs_tokens));
  }
  if (!rows.empty()) {
    ranks[0].be->sample_start(logits, rows);
    f->sampled = true;
  }
  sched->launched(f->plan);
  return f;
}

SampleRow Engine::Impl::sample_row(const Request& q, int ahead, bool& needs_tokens) const {
  const SamplingOptions& o = q.opts;
  SampleRow row;
  row.temperature = o.temperature;
  row.top_k = o.top_k;
  row.top_p = o.top_p;
  row.min_p = o.min_p;
  row.repetition_penalty = o.repetition_penalty;
  row.presence_penalty = o.presence_penalty;
  row.frequency_penalty = o.frequency_penalty;
  row.seed = q.seed;
  row.draw = int64_t(q.output.size()) + ahead;
  row.num_logprobs = o.logprobs;
  needs_tokens = needs_tokens || o.penalized();
  if (o.repetition_penalty != 1.0f) {
    std::set<int32_t> seen(q.prompt.begin(), q.prompt.end());
    seen.insert(q.output.begin(), q.output.end());
    row.seen_tokens.assign(seen.begin(), seen.end());
  }
  if (o.presence_penalty != 0.0f || o.frequency_penalty != 0.0f)
    for (auto [t, c] : q.output_counts) {
      row.output_tokens.push_back(t);
      row.output_counts.push_back(c);
    }
  if (int(q.output.size()) + ahead < o.min_tokens) {
    row.banned_tokens = o.stop_token_ids;
    if (!o.ignore_eos) row.banned_tokens.insert(row.banned_tokens.end(), o.eos_token_ids.begin(), o.eos_token_ids.end());
  }
  return row;
}

void Engine::Impl::complete(std::unique_ptr<Flight> f) {
  completing = f.get();
  struct Done {
    Flight*& p;
    ~Done() { p = nullptr; }
  } done{completing};
  SampleResult res;
  if (f->sampled) ranks[0].be->sample_finish(res, opt.comm_timeout_s);
  std::vector<std::pair<int, int>> rollbacks;  // (kept state slot, request slot): drafts rejected after a row
  {
    std::lock_guard<std::mutex> lk(mu);
    int ri = 0;
    for (const auto& s : f->plan.seqs) {
      if (!s.sample) continue;
      const int row = ri;
      ri += s.rows();
      Request& q = *s.req;
      if (q.finished) continue;  // cancelled (or failed) while the step ran
      // The draft tokens that equal the samples before them stand (the samples are those of a run without them),
      // then the first sample that differs from the draft (or follows all of it).
      int n = 0;
      while (n < int(s.draft.size()) && s.draft[size_t(n)] == res.tokens[size_t(row + n)]) ++n;
      bool finite = true;
      for (int i = 0; i <= n; ++i) finite = finite && !std::isnan(res.logprobs[size_t(row + i)]);
      if (!finite) {  // the sampler's sign of non-finite logits (ops.h): this request only
        finish(sched->remove(&q), Finish::Error, kNonFiniteLogits);
        continue;
      }
      Finish fin;
      int taken = 1;
      if (s.draft.empty()) {
        fin = sched->sampled(s, row, res.tokens[size_t(row)]);
      } else {
        fin = sched->accepted(s, std::vector<int32_t>(res.tokens.begin() + row, res.tokens.begin() + row + n + 1),
                              &taken);
        snapshot.spec_drafted += int64_t(s.draft.size());
        snapshot.spec_accepted += n;
        q.draft_acceptance = 0.75f * q.draft_acceptance + 0.25f * float(n) / float(s.draft.size());
        if (q.draft_acceptance < opt.speculative_min_acceptance) {
          q.plain_steps = opt.speculative_pause_steps;
          snapshot.spec_pauses++;
        }
        snapshot.spec_accepted_at.resize(size_t(opt.speculative_tokens), 0);
        for (int i = 0; i < n; ++i) snapshot.spec_accepted_at[size_t(i)]++;
        if (fin == Finish::None && n < int(s.draft.size()) && s.keep >= 0) rollbacks.emplace_back(s.keep + n, q.slot);
      }
      for (int i = 0; i < taken; ++i) publish_token(q, res, row + i);
      if (fin != Finish::None) finish(sched->remove(&q), fin);
    }
    snapshot.steps++;
    update_snapshot();
  }
  out_cv.notify_all();
  if (!rollbacks.empty())  // state models: each slot back to the state after its last confirmed row
    on_ranks([&](int, Rank& rk) {
      for (auto [from, to] : rollbacks) rk.state->copy_slot(from, to);
    });
  if (opt.speculative_tokens > 0) draft(f->plan);
}

PageMoves Engine::Impl::to_frames(StepInput& in) {
  PageMoves moves = tiers->prepare(in, sched->pool().take_dropped(), opt.page_size);
  std::lock_guard<std::mutex> lk(mu);
  snapshot.kv_bytes_to_host += int64_t(moves.out.size() * host_page_bytes);
  snapshot.kv_bytes_to_device += int64_t(moves.in.size() * host_page_bytes);
  snapshot.page_reads_device += moves.reads_device;
  snapshot.page_reads_host += moves.reads_host;
  snapshot.pages_on_device = tiers->on_device();
  snapshot.pages_on_host = tiers->on_host();
  return moves;
}

void Engine::Impl::draft(const Plan& plan) {
  const int k = opt.speculative_tokens, ps = opt.page_size;
  // One pass over `in` on every rank (its pages as frames with a host tier), then each logit row's greedy token.
  auto pass = [&](StepInput& in, const std::vector<int32_t>& hidden, bool from_draft) {
    PageMoves moves;
    if (tiers) moves = to_frames(in);
    Tensor logits;
    on_ranks([&](int r, Rank& rk) {
      if (tiers) rk.kv->move(moves);
      Tensor l = rk.model->draft(in, hidden, from_draft, *rk.kv);
      if (r == 0) logits = l;
    });
    SampleResult res;
    if (!in.logit_rows.empty()) {
      std::vector<SampleRow> rows(in.logit_rows.size());
      for (SampleRow& row : rows) row.temperature = 0;  // greedy
      ranks[0].be->sample(logits, rows, res);
    }
    return res.tokens;
  };
  auto add_seq = [&](StepInput& in, const Request& q, int first, int n) {
    const std::vector<int>& pages = sched->pages(q);
    for (int pos = first; pos < first + n; ++pos) {
      in.tokens.push_back(q.length() > pos + 1 ? q.token_at(pos + 1) : 0);
      in.token_src.push_back(-1);
      in.positions.push_back(pos);
      in.kv_rows.push_back(pages[size_t(pos / ps)] * ps + pos % ps);
    }
    in.q_start.push_back(int32_t(in.tokens.size()));
    in.ctx_len.push_back(first + n);
    in.max_q_len = std::max(in.max_q_len, n);
    in.max_ctx_len = std::max(in.max_ctx_len, first + n);
    in.max_pages = std::max(in.max_pages, (first + n + ps - 1) / ps);
  };
  auto page_tables = [&](StepInput& in, const std::vector<const Request*>& seqs) {
    for (const Request* q : seqs) {
      const std::vector<int>& pages = sched->pages(*q);
      for (int j = 0; j < in.max_pages; ++j) in.page_table.push_back(j < int(pages.size()) ? pages[size_t(j)] : 0);
    }
  };
  // Pass 1: every position the step confirmed (its K/V stand), with the token that follows it and its hidden
  // state; a request that decodes next drafts from its last one.
  struct Drafter {
    Request* req;
    int row;  // its row in the last pass
    int pos;  // that row's position
    int want; // draft tokens it can feed next step
  };
  std::vector<Drafter> drafters;
  StepInput in;
  std::vector<int32_t> hidden;
  std::vector<const Request*> seqs;
  in.q_start.push_back(0);
  int step_row = 0;
  for (const auto& s : plan.seqs) {
    const int row0 = step_row;
    step_row += s.count;
    Request& q = *s.req;
    if (q.finished || q.slot < 0) continue;
    const int confirmed = q.computed - s.first;
    if (confirmed <= 0) continue;
    add_seq(in, q, s.first, confirmed);
    seqs.push_back(&q);
    for (int j = 0; j < confirmed; ++j) hidden.push_back(row0 + j);
    const SamplingOptions& o = q.opts;
    int room = std::min(o.max_tokens - int(q.output.size()), opt.max_model_len - q.length()) - 1;
    // With sparse decode, verification rows attend to every page (selection is per sequence, for one-row decodes):
    // drafts stop where the plain run would start selecting, so the output stays the plain run's.
    if (sparse.budget_pages > 0) room = std::min(room, sparse.budget_pages * ps - q.length());
    if (q.plain_steps > 0) {  // drafts stopped paying: plain decode for a while (then one more try)
      --q.plain_steps;
      continue;
    }
    if (q.computed != q.length() - 1 || !o.speculative || o.penalized() || room < 1 ||
        int(drafters.size()) >= opt.speculative_max_batch)
      continue;
    // Pages for the positions the drafts' passes and the next step write.
    int want = std::min(k, room);
    while (want > 0 && !sched->grow(q, q.length() + want)) --want;
    if (want == 0) continue;
    in.logit_rows.push_back(int32_t(in.tokens.size()) - 1);
    drafters.push_back({&q, int(in.tokens.size()) - 1, q.computed - 1, want});
  }
  if (in.tokens.empty()) return;
  page_tables(in, seqs);
  std::vector<int32_t> tokens = pass(in, hidden, false);
  for (size_t i = 0; i < drafters.size(); ++i) drafters[i].req->draft = {tokens[i]};
  // Passes 2..k: each drafter's next position, from its last draft token and the pass's own hidden state there.
  for (int j = 2; j <= k; ++j) {
    StepInput next;
    std::vector<int32_t> rows;
    std::vector<const Request*> next_seqs;
    std::vector<Drafter*> active;
    next.q_start.push_back(0);
    for (Drafter& d : drafters) {
      if (d.want < j) continue;
      Request& q = *d.req;
      const int pos = d.pos + 1;
      add_seq(next, q, pos, 1);
      next.tokens.back() = q.draft.back();
      next.logit_rows.push_back(int32_t(next.tokens.size()) - 1);
      rows.push_back(d.row);
      next_seqs.push_back(&q);
      d.row = int(next.tokens.size()) - 1;
      d.pos = pos;
      active.push_back(&d);
    }
    if (active.empty()) break;
    page_tables(next, next_seqs);
    tokens = pass(next, rows, true);
    for (size_t i = 0; i < active.size(); ++i) active[i]->req->draft.push_back(tokens[i]);
  }
}

Engine::Engine(const ModelConfig& cfg, const std::vector<TensorSource>& tensors, const EngineOptions& opts,
               const Progress& progress)
    : forks_at_birth_(fork_count()), impl_(std::make_unique<Impl>()) {
  impl_->cfg = cfg;
  impl_->opt = opts;
  validate(cfg);
  on_own_thread([&] {
    try {
      impl_->build(tensors, progress);
    } catch (...) {
      impl_->release_ranks();  // here too, not on the caller's thread
      throw;
    }
  });
  impl_->loop_thread = std::thread([this] { impl_->loop(); });
}

Engine::~Engine() { close(); }

void Engine::check_process() const {
  if (fork_count() != forks_at_birth_)
    throw std::runtime_error("this engine was made in the parent of this fork()ed process, where its threads "
                             "stayed: make a new Generator in the child (or start it with 'spawn')");
}

int64_t Engine::submit(const std::vector<int32_t>& prompt, const SamplingOptions& o) {
  check_process();
  Impl& m = *impl_;
  const int V = m.cfg.vocab_size;
  QRT_CHECK_ARG(!prompt.empty(), "prompt is empty");
  for (int32_t t : prompt) QRT_CHECK_ARG(t >= 0 && t < V, "prompt token id ", t, " is outside the vocabulary [0, ", V, ")");
  QRT_CHECK_ARG(o.max_tokens >= 1, "max_tokens must be >= 1, got ", o.max_tokens);
  QRT_CHECK_ARG(o.min_tokens >= 0 && o.min_tokens <= o.max_tokens, "min_tokens must be in [0, max_tokens]");
  QRT_CHECK_ARG(std::isfinite(o.temperature) && o.temperature >= 0, "temperature must be >= 0, got ", o.temperature);
  // 1 / temperature scales the logits in fp32: below 1e-6 it overflows them (use 0 for greedy).
  QRT_CHECK_ARG(o.temperature == 0 || o.temperature >= 1e-6f, "temperature must be 0 (greedy) or >= 1e-6, got ",
                o.temperature);
  QRT_CHECK_ARG(o.top_k >= 0, "top_k must be >= 0 (0 turns it off), got ", o.top_k);
  QRT_CHECK_ARG(o.top_p > 0 && o.top_p <= 1, "top_p must be in (0, 1], got ", o.top_p);
  QRT_CHECK_ARG(o.min_p >= 0 && o.min_p <= 1, "min_p must be in [0, 1], got ", o.min_p);
  QRT_CHECK_ARG(std::isfinite(o.repetition_penalty) && o.repetition_penalty > 0,
                "repetition_penalty must be > 0, got ", o.repetition_penalty);
  QRT_CHECK_ARG(std::isfinite(o.presence_penalty) && std::isfinite(o.frequency_penalty),
                "presence_penalty and frequency_penalty must be finite");
  QRT_CHECK_ARG(o.logprobs >= 0 && o.logprobs <= V, "logprobs must be in [0, vocab size]");
  for (int32_t t : o.stop_token_ids) QRT_CHECK_ARG(t >= 0 && t < V, "stop token id ", t, " is outside the vocabulary");
  const int64_t total = int64_t(prompt.size()) + o.max_tokens;
  QRT_CHECK_ARG(int64_t(prompt.size()) < m.opt.max_model_len, "prompt has ", prompt.size(),
                " tokens; max_model_len is ", m.opt.max_model_len);
  QRT_CHECK_ARG(total <= m.opt.max_model_len, "prompt (", prompt.size(), " tokens) + max_tokens (", o.max_tokens,
                ") = ", total, " exceeds max_model_len ", m.opt.max_model_len);
  // The KV cache holds every token that is fed: the prompt and all outputs but the last (sampled, never fed).
  const int64_t cap = int64_t(m.sched->total_pages()) * m.opt.page_size;
  QRT_CHECK_ARG(total - 1 <= cap, "prompt + max_tokens - 1 = ", total - 1, " tokens exceeds the KV cache (", cap,
                " tokens); raise kv_cache_memory");
  std::lock_guard<std::mutex> lk(m.mu);
  if (m.closed) throw std::runtime_error("the engine is closed");
  if (!m.failed.empty()) throw std::runtime_error(m.failed);
  auto r = std::make_unique<Request>();
  r->id = m.next_id++;
  r->prompt = prompt;
  r->opts = o;
  r->seed = o.seed >= 0 ? uint64_t(o.seed) : hash3(m.opt.seed, uint64_t(r->id), 0x5eed);
  const int64_t id = r->id;
  m.channels[id] = RequestOutput{};
  m.incoming.push_back(std::move(r));
  m.snapshot.waiting++;
  m.work_cv.notify_all();
  return id;
}

void Engine::cancel(int64_t id) {
  check_process();
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  if (!m.channels.count(id)) return;  // finished already (or unknown): nothing to do
  for (auto it = m.incoming.begin(); it != m.incoming.end(); ++it)
    if ((*it)->id == id) {
      // Not in any step (the loop has not taken it): its end goes to the channel, without `launched`, which
      // only the loop thread touches.
      m.end_channel(**it, Finish::Cancelled);
      m.incoming.erase(it);
      m.snapshot.waiting--;  // submit's count
      m.out_cv.notify_all();
      return;
    }
  m.cancels.push_back(id);
  m.work_cv.notify_all();
}

void Engine::release(int64_t id) {
  check_process();
  Impl& m = *impl_;
  cancel(id);
  std::lock_guard<std::mutex> lk(m.mu);
  const auto it = m.channels.find(id);
  if (it == m.channels.end()) return;  // ended and taken already, or unknown
  const bool ended = it->second.finish != Finish::None;
  m.channels.erase(it);
  if (!ended) m.released.insert(id);  // the loop ends it soon (the cancel above) and forgets the id then
  m.out_cv.notify_all();              // a waiter on the id (there should be none) learns it is gone
}

RequestOutput Engine::wait(int64_t id, double timeout_s, bool until_finished) {
  check_process();
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lk(m.mu);
  QRT_CHECK_ARG(m.channels.count(id), "unknown or finished request id ", id);
  // The channel is looked up again after every wake (ids are never reused): another thread waiting on the same
  // id may have taken the request's end and erased it.
  wait_seconds(m.out_cv, lk, timeout_s, [&] {
    const auto c = m.channels.find(id);
    return c == m.channels.end() || c->second.finish != Finish::None ||
           (!until_finished && !c->second.tokens.empty());
  });
  const auto it = m.channels.find(id);
  QRT_CHECK_ARG(it != m.channels.end(), "request id ", id, " finished while waiting: another wait took its end");
  RequestOutput o = std::move(it->second);
  it->second = RequestOutput{};
  it->second.top_n = o.top_n;
  it->second.cached_tokens = o.cached_tokens;
  if (o.finish != Finish::None) m.channels.erase(it);
  return o;
}

int64_t Engine::wait_any(const std::vector<int64_t>& ids, double timeout_s) {
  check_process();
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lk(m.mu);
  int64_t ready = -1;
  wait_seconds(m.out_cv, lk, timeout_s, [&] {
    for (int64_t id : ids) {
      const auto c = m.channels.find(id);
      if (c == m.channels.end() || c->second.finish != Finish::None || !c->second.tokens.empty()) {
        ready = id;
        return true;
      }
    }
    return false;
  });
  return ready;
}

EngineStats Engine::stats() const {
  check_process();
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->snapshot;
}

void Engine::close() {
  if (!impl_) return;
  if (fork_count() != forks_at_birth_) {  // a fork()ed child: no thread to join, maybe a lock held for good
    (void)impl_.release();
    return;
  }
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.closed) return;
    m.closed = true;
    m.stop = true;
  }
  m.work_cv.notify_all();
  if (m.loop_thread.joinable()) m.loop_thread.join();
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.sched)
      for (Request* r : m.sched->all_requests()) m.finish(m.sched->remove(r), Finish::Cancelled);
    while (!m.incoming.empty()) {
      m.finish(std::move(m.incoming.front()), Finish::Cancelled);
      m.incoming.pop_front();
    }
    if (m.sched) m.update_snapshot();  // the loop has stopped: stats() says that nothing runs or waits
    m.out_cv.notify_all();
  }
  try {
    on_own_thread([&m] { m.release_ranks(); });
  } catch (...) {  // no thread to be had: free them here
    m.release_ranks();
  }
}

void Engine::Impl::release_ranks() noexcept {
  // Free device memory rank by rank on each rank's own thread (all of them up), then the threads.
  if (!ranks.empty() && workers.size() + 1 == ranks.size()) {
    try {
      on_ranks([](int, Rank& rk) {
        try {
          if (rk.be) rk.be->synchronize();
        } catch (...) {  // a failed device: free what can be freed
        }
        rk.kv.reset();
        rk.state.reset();
        rk.model.reset();
        if (rk.be) rk.be->drop_graphs();  // first: NCCL's destroy waits for graphs that captured collectives
        rk.comm.reset();
        rk.be.reset();
      }, kNoLimit);  // with a bound, on_ranks' late path would abort communicators their ranks are freeing
    } catch (...) {
    }
  }
  workers.clear();
  ranks.clear();
}

}  // namespace qrt
