// Randomized check of the scheduler under the engine's step bookkeeping; tests/test_scheduler_sim.py builds
// it with the real cpp/engine/scheduler.cpp and cpp/kv/pages.cpp and runs it.
//
// A stand-in device writes a tag (request, position, token) into every K/V row a step fills and samples each
// sequence's next token as a hash of the context it reads back through the step's page table. A token fed at
// the wrong position, a page reused while it is live, a write into a page another request holds (a shared
// prefix), or a context read from the wrong rows would change the tokens or fail a check. Every request's tokens
// are compared with the same request run alone, over random page sizes, pool sizes, budgets, batch sizes and
// limits, with preemption, cancellation, stop tokens, min_tokens, requests with penalties (which make the engine
// complete a step before planning the next), and prompts that share prefixes, with the prefix cache on or off, a
// host tier, and speculation (drafts made as Engine::Impl::draft makes them, verified as complete() verifies them).
//
// The requests' bookkeeping around a step is the engine's own (Scheduler::launched and Scheduler::sampled); only
// the loop's order in step() mirrors Engine::Impl::step (change them together) and the device is modelled here.
//   scheduler_sim [seeds]   prints "ok (<counts>)" and exits 0, or prints the first failure and exits 1
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "engine/scheduler.h"
#include "kv/tiers.h"

using namespace qrt;

namespace {

constexpr int kVocab = 23;
constexpr int32_t kEos = 3, kStopToken = 5;

bool g_failed = false;
#define FAIL(...) (std::printf(__VA_ARGS__), std::printf("\n"), g_failed = true)

bool contains(const std::vector<int32_t>& v, int32_t t) { return std::find(v.begin(), v.end(), t) != v.end(); }

std::vector<int32_t> banned_tokens(const SamplingOptions& o, int produced) {
  std::vector<int32_t> b;
  if (produced < o.min_tokens) {
    b = o.stop_token_ids;
    if (!o.ignore_eos) b.insert(b.end(), o.eos_token_ids.begin(), o.eos_token_ids.end());
  }
  return b;
}

// The stand-in model: the next token is a hash of the whole context, moved past banned tokens.
int32_t next_token(const std::vector<int32_t>& context, const std::vector<int32_t>& banned) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : context) h = (h ^ (uint64_t(t) + 0x9e37)) * 1099511628211ull;
  int32_t t = int32_t((h >> 17) % kVocab);
  while (contains(banned, t)) t = (t + 1) % kVocab;
  return t;
}

Finish end_after(const SamplingOptions& o, int prompt_len, int produced, int32_t t, int max_model_len) {
  const bool stop_token = contains(o.stop_token_ids, t) || (!o.ignore_eos && contains(o.eos_token_ids, t));
  if (stop_token && produced >= o.min_tokens) return Finish::Stop;
  if (produced >= o.max_tokens || prompt_len + produced >= max_model_len) return Finish::Length;
  return Finish::None;
}

struct Expected {
  std::vector<int32_t> tokens;
  Finish finish = Finish::None;
};

Expected run_alone(const std::vector<int32_t>& prompt, const SamplingOptions& o, int max_model_len) {
  Expected e;
  std::vector<int32_t> context = prompt;
  while (e.finish == Finish::None) {
    const int32_t t = next_token(context, banned_tokens(o, int(e.tokens.size())));
    e.tokens.push_back(t);
    context.push_back(t);
    e.finish = end_after(o, int(prompt.size()), int(e.tokens.size()), t, max_model_len);
  }
  return e;
}

struct RowTag {
  int64_t id = -1;
  int pos = -1;
  int32_t token = -1;
  uint64_t context = 0;  // hash of the writer's tokens [0, pos]: the K/V of a row depend on all of them
};

// Hashes of a token sequence's prefixes: h[i] covers tokens [0, i].
std::vector<uint64_t> prefix_hashes(const std::vector<int32_t>& tokens) {
  std::vector<uint64_t> h;
  uint64_t x = 88172645463325252ull;
  for (int32_t t : tokens) {
    x = (x ^ (uint64_t(t) + 0x51ed27)) * 0x100000001b3ull;
    h.push_back(x ^ (x >> 31));
  }
  return h;
}

// A slot's (or a snapshot's) recurrent state: that after `pos` tokens of the context hashed as `context`.
struct StateTag {
  int pos = -1;
  uint64_t context = 0;
};

struct Flight {
  Plan plan;
  bool needs_tokens = false;
  std::vector<int32_t> sampled;                // the step's tokens, one per sampled sequence
  std::vector<std::unique_ptr<Request>> retired;  // finished while this step was in flight
  std::vector<int> read_frames, written_frames;    // with a host tier: the frames the step reads and writes
};

struct Sim {
  SchedulerOptions opt;
  bool overlap = true;
  std::unique_ptr<Scheduler> sched;
  std::unique_ptr<Flight> launched;
  Flight* completing = nullptr;  // the step complete() works on
  // With a host tier (kv/tiers.h): the device reads and writes frames, and the tags move with the frames' rows.
  std::unique_ptr<TierMap> tiers;
  int device_frames = 0, host0 = 0;  // host frames from host0 on (staging frames between: ops.h KvStaging)
  int64_t frame_moves = 0, beside_moves = 0;
  const Flight* in_flight = nullptr;  // the step that may still run while the next one is launched
  // Speculation (opt.speculative_tokens): drafts made as the engine's draft() makes them, each token the right one
  // half of the time; drafted and confirmed counts.
  uint64_t draft_rng = 1;
  int64_t drafted = 0, confirmed = 0;
  int draw(int n) {  // uniform in [0, n)
    draft_rng = draft_rng * 6364136223846793005ull + 1442695040888963407ull;
    return int((draft_rng >> 33) % uint64_t(n));
  }
  std::vector<RowTag> kv;               // one tag per K/V row (pages + 1 scratch page), or per frame row
  std::vector<StateTag> slot_state, snapshot_state;  // state models: each slot's and each snapshot's state
  std::vector<int32_t> device_sampled;  // the last step's sampled tokens, as token_src reads them
  std::map<int64_t, std::vector<int32_t>> prompts, published;
  std::map<int64_t, std::vector<uint64_t>> contexts;  // prefix hashes of each request's prompt and expected output
  std::map<int64_t, std::vector<uint64_t>> fed_hashes;  // speculation: of its known tokens and its last draft
  std::map<int64_t, Expected> expected;
  std::map<int64_t, Finish> ended;
  std::set<int64_t> penalized, admitted;
  std::vector<int64_t> admission_order;
  int64_t cached_tokens = 0, shared_reads = 0, state_restores = 0;

  void finish(std::unique_ptr<Request> r, Finish f) {
    if (ended.count(r->id)) FAIL("request %lld ended twice", (long long)r->id);
    ended[r->id] = f;
    r->finished = true;
    // As the engine's retire(): kept by the step in flight, or by the one being completed (its drafts come after).
    Flight* keep = launched ? launched.get() : completing;
    if (keep) keep->retired.push_back(std::move(r));
  }

  void check_plan(const Plan& p) {
    const StepInput& in = p.input;
    int tokens = 0;
    std::map<int, int> pages;  // page -> sequences of this step that hold it
    if (int(p.seqs.size()) > opt.max_batch_size) FAIL("%zu sequences in a step of at most %d", p.seqs.size(), opt.max_batch_size);
    for (size_t s = 0; s < p.seqs.size(); ++s) {
      const auto& q = p.seqs[s];
      tokens += q.count;
      if (q.count < 1) FAIL("a sequence of %d tokens", q.count);
      if (q.req->finished) FAIL("request %lld planned after it finished", (long long)q.req->id);
      if (q.first + q.count - int(q.draft.size()) > q.req->length() || q.first + q.count > opt.max_model_len)
        FAIL("fed past the end");
      for (int j = 0; j < (q.first + q.count + opt.page_size - 1) / opt.page_size; ++j) {
        const int page = in.page_table[s * in.max_pages + j];
        if (page < 0 || page >= opt.num_pages) FAIL("page %d outside the pool", page);
        if (++pages[page] > sched->pool().holders(page))
          FAIL("page %d in %d sequences of one step, held by %d requests", page, pages[page],
               sched->pool().holders(page));
      }
      if (q.req->preempted == 0 && admitted.insert(q.req->id).second) admission_order.push_back(q.req->id);
    }
    if (tokens > opt.max_num_batched_tokens) FAIL("%d tokens in a step of at most %d", tokens, opt.max_num_batched_tokens);
  }

  // The device's part: K/V rows written, then each sampled sequence's context read back and a token drawn.
  // The row of position j that sequence s of a step reads must hold its own token there, computed from its own
  // tokens before it (written by it, or by another request with the same prefix).
  void check_row(const Plan& p, size_t s, int j) {
    const StepInput& in = p.input;
    const int ps = opt.page_size;
    const Request& r = *p.seqs[s].req;
    const RowTag& tag = kv[size_t(in.page_table[s * in.max_pages + j / ps] * ps + j % ps)];
    const auto& h = contexts[r.id];
    if (tag.pos != j || size_t(j) >= h.size() || tag.context != h[size_t(j)])
      FAIL("request %lld reads position %d from a row of request %lld position %d token %d, another context",
           (long long)r.id, j, (long long)tag.id, tag.pos, tag.token);
    if (tag.id != r.id) shared_reads++;
  }

  // State models, in the engine's order: the restores of the step's hits, the step (a sequence starts from zeros at
  // position 0, else from its slot's state, which must be that after its own tokens before the chunk), the
  // snapshots at page boundaries.
  void run_state(const Plan& p) {
    const int ps = opt.page_size;
    for (const auto& q : p.seqs)
      if (q.restore >= 0) {
        slot_state[size_t(q.req->slot)] = snapshot_state.at(size_t(q.restore));
        state_restores++;
      }
    for (const auto& q : p.seqs) {
      const auto& h = contexts[q.req->id];
      StateTag& st = slot_state[size_t(q.req->slot)];
      if (q.first > 0 && (st.pos != q.first || st.context != h[size_t(q.first - 1)]))
        FAIL("request %lld resumes at position %d from a state after %d tokens of another context", (long long)q.req->id,
             q.first, st.pos);
      const size_t last = size_t(q.first + q.count - 1);
      st = StateTag{q.first + q.count, last < h.size() ? h[last] : 0};  // past the run alone: a draft, rolled back
    }
    for (const auto& q : p.seqs)
      if (q.snapshot >= 0) {
        if ((q.first + q.count) % ps) FAIL("a snapshot after %d tokens, not at a page boundary", q.first + q.count);
        snapshot_state.at(size_t(q.snapshot)) = slot_state[size_t(q.req->slot)];
      }
  }

  std::vector<int32_t> run_on_device(const Plan& p) {
    const StepInput& in = p.input;
    const int ps = opt.page_size;
    std::set<int> written;  // rows this step writes
    int k = 0;
    for (size_t s = 0; s < p.seqs.size(); ++s) {
      const auto& q = p.seqs[s];
      const auto& prompt = prompts[q.req->id];
      const auto& want_out = expected[q.req->id].tokens;
      const int len = int(prompt.size() + q.req->output.size());  // drafts are fed from here on
      // The hashes of the tokens this step feeds after the known ones (a draft may be wrong).
      std::vector<uint64_t> fed_h;
      if (!q.draft.empty()) {
        std::vector<int32_t> fed = prompt;
        fed.insert(fed.end(), q.req->output.begin(), q.req->output.end());
        fed.insert(fed.end(), q.draft.begin(), q.draft.end());
        fed_h = prefix_hashes(fed);
        fed_hashes[q.req->id] = fed_h;
      }
      for (int i = q.first; i < q.first + q.count; ++i, ++k) {
        int32_t t = in.tokens[k];
        if (in.token_src[k] >= 0) t = in.token_src[k] < int(device_sampled.size()) ? device_sampled[in.token_src[k]] : -7;
        const size_t o = size_t(i) - prompt.size();
        const bool drafted_row = i >= len && !q.draft.empty();
        const int32_t want = drafted_row ? q.draft[size_t(i - len)]
                             : i < int(prompt.size()) ? prompt[i] : o < want_out.size() ? want_out[o] : -9;
        if (t != want) FAIL("request %lld position %d fed %d, want %d", (long long)q.req->id, i, t, want);
        if (in.positions[k] != i) FAIL("position %d fed as %d", i, in.positions[k]);
        const int row = in.kv_rows[k];
        if (row / ps != in.page_table[s * in.max_pages + i / ps] || row % ps != i % ps) FAIL("kv_row off its page");
        if (!tiers && sched->pool().holders(row / ps) != 1)
          FAIL("request %lld writes position %d into page %d, which %d requests hold", (long long)q.req->id, i,
               row / ps, sched->pool().holders(row / ps));
        const auto& h = drafted_row ? fed_h : contexts[q.req->id];
        kv[size_t(row)] = RowTag{q.req->id, i, t, size_t(i) < h.size() ? h[size_t(i)] : 0};
        written.insert(row);
      }
    }
    if (opt.has_state) run_state(p);
    // Every sequence's attention reads the rows before its chunk: none of them may be one this step writes (the
    // kernels do not order one sequence's K/V writes before another's reads).
    for (size_t s = 0; s < p.seqs.size(); ++s)
      for (int j = 0; j < p.seqs[s].first; ++j) {
        const int row = in.page_table[s * in.max_pages + j / ps] * ps + j % ps;
        if (written.count(row))
          FAIL("request %lld reads position %d from a row this step writes", (long long)p.seqs[s].req->id, j);
        check_row(p, s, j);
      }
    std::vector<int32_t> sampled;
    for (size_t s = 0; s < p.seqs.size(); ++s) {
      const auto& q = p.seqs[s];
      if (!q.sample) continue;
      // One row, or one per fed token with a draft (each samples the token after it; rows past the known tokens read
      // this step's drafts).
      const int rows = q.rows(), len = int(q.req->prompt.size() + q.req->output.size());
      for (int r = 0; r < rows; ++r) {
        std::vector<int32_t> context;
        for (int j = 0; j < in.ctx_len[s] - (rows - 1 - r); ++j) {
          if (j < len || q.draft.empty()) check_row(p, s, j);
          context.push_back(kv[size_t(in.page_table[s * in.max_pages + j / ps] * ps + j % ps)].token);
        }
        sampled.push_back(next_token(context, banned_tokens(q.req->opts, int(q.req->output.size()) + r)));
      }
    }
    return sampled;
  }

  // The engine's host tier: the step's pages as frames, after the frames' moves (tags copied row by row).
  Plan framed(const Plan& p) {
    const int ps = opt.page_size;
    for (int32_t row : p.input.kv_rows)
      if (sched->pool().holders(row / ps) != 1) FAIL("a step writes page %d, which %d requests hold", row / ps,
                                                     sched->pool().holders(row / ps));
    Plan f;
    f.seqs = p.seqs;
    f.input = p.input;
    const PageMoves m = tiers->prepare(f.input, sched->pool().take_dropped(), ps);
    // Copies that run beside the step in flight (PageMoves::beside) neither write a frame it reads or writes nor
    // read a frame it writes.
    if (m.beside && in_flight) {
      auto used = [](const std::vector<int>& v, int frame) { return std::find(v.begin(), v.end(), frame) != v.end(); };
      for (const auto* list : {&m.out, &m.in})
        for (const auto& [from, to] : *list) {
          if (used(in_flight->read_frames, to) || used(in_flight->written_frames, to))
            FAIL("a copy beside the step in flight writes frame %d, which that step uses", to);
          if (used(in_flight->written_frames, from))
            FAIL("a copy beside the step in flight reads frame %d, which that step writes", from);
          beside_moves++;
        }
    }
    for (const auto* list : {&m.out, &m.in})
      for (const auto& [from, to] : *list) {
        if ((list == &m.out) != (from < device_frames && to >= host0)) FAIL("a move between the wrong tiers");
        if ((list == &m.in) != (from >= host0 && to < device_frames)) FAIL("a move between the wrong tiers");
        for (int j = 0; j < ps; ++j) kv[size_t(to * ps + j)] = kv[size_t(from * ps + j)];
        frame_moves++;
      }
    for (int32_t row : f.input.kv_rows)
      if (row / ps >= device_frames) FAIL("a step writes frame %d, not a device frame", row / ps);
    if (tiers->on_device() > device_frames) FAIL("%d pages on %d device frames", tiers->on_device(), device_frames);
    return f;
  }

  std::unique_ptr<Flight> launch(Plan plan) {
    check_plan(plan);
    auto f = std::make_unique<Flight>();
    f->plan = std::move(plan);
    if (tiers) {
      const Plan fp = framed(f->plan);
      const int ps = opt.page_size;
      const StepInput& in = fp.input;
      for (int q = 0; q < in.num_seqs(); ++q)
        for (int c = 0; c < (in.ctx_len[size_t(q)] + ps - 1) / ps; ++c)
          f->read_frames.push_back(in.page_table[size_t(q) * size_t(in.max_pages) + size_t(c)]);
      for (int32_t row : in.kv_rows) f->written_frames.push_back(row / ps);
      f->sampled = run_on_device(fp);
    } else {
      f->sampled = run_on_device(f->plan);
    }
    if (!f->sampled.empty()) device_sampled = f->sampled;
    for (auto& s : f->plan.seqs) {
      const Request& q = *s.req;
      if (s.sample && penalized.count(q.id)) {
        f->needs_tokens = true;  // penalties read the output: no pending token may be in it
        if (contains(q.output, kPending)) FAIL("request %lld has penalties and a pending token", (long long)q.id);
      }
    }
    sched->launched(f->plan);  // the engine's own bookkeeping
    return f;
  }

  void complete(std::unique_ptr<Flight> f) {
    completing = f.get();
    int row = 0;
    for (const auto& s : f->plan.seqs) {
      if (!s.sample) continue;
      const int r = row;
      row += s.rows();
      Request& q = *s.req;
      if (q.finished) continue;
      if (!s.draft.empty()) {  // the engine's verification: the draft tokens equal to the samples before them stand
        int n = 0;
        while (n < int(s.draft.size()) && s.draft[size_t(n)] == f->sampled[size_t(r + n)]) ++n;
        const std::vector<int32_t> tokens(f->sampled.begin() + r, f->sampled.begin() + r + n + 1);
        int taken = 0;
        const Finish fin = sched->accepted(s, tokens, &taken);
        drafted += int64_t(s.draft.size());
        confirmed += n;
        auto& out = published[q.id];
        if (int(out.size()) != s.out_index) FAIL("request %lld publishes token %d after %zu", (long long)q.id, s.out_index, out.size());
        for (int i = 0; i < taken; ++i) {
          out.push_back(tokens[size_t(i)]);
          const Finish want = end_after(q.opts, int(q.prompt.size()), s.out_index + i + 1, tokens[size_t(i)],
                                        opt.max_model_len);
          if (want != (i + 1 == taken ? fin : Finish::None))
            FAIL("request %lld ends %d after token %d of a draft, the oracle says otherwise", (long long)q.id,
                 int(fin), s.out_index + i);
        }
        if (fin == Finish::None && opt.has_state && n < int(s.draft.size()))  // the engine's rollback
          slot_state[size_t(q.slot)] = StateTag{s.first + n + 1, contexts[q.id][size_t(s.first + n)]};
        if (fin != Finish::None) finish(sched->remove(&q), fin);
        continue;
      }
      const int32_t t = f->sampled[r];
      const Finish fin = sched->sampled(s, r, t);  // the engine's own bookkeeping; end_after is the oracle's
      auto& out = published[q.id];
      if (int(out.size()) != s.out_index) FAIL("request %lld publishes token %d after %zu", (long long)q.id, s.out_index, out.size());
      out.push_back(t);
      if (fin != end_after(q.opts, int(q.prompt.size()), s.out_index + 1, t, opt.max_model_len))
        FAIL("request %lld ends %d after token %d, the oracle says otherwise", (long long)q.id, int(fin), s.out_index);
      if (fin != Finish::None) finish(sched->remove(&q), fin);
    }
    if (opt.speculative_tokens > 0) draft(f->plan);
    completing = nullptr;
  }

  // Engine::Impl::draft's choices: requests of the step that decode next, without penalties, with room for a draft
  // and pages for it, up to speculative_max_batch of them.
  void draft(const Plan& plan) {
    int drafters = 0;
    for (const auto& s : plan.seqs) {
      Request& q = *s.req;
      if (q.finished || q.slot < 0 || q.computed != q.length() - 1 || penalized.count(q.id)) continue;
      const int room = std::min(q.opts.max_tokens - int(q.output.size()), opt.max_model_len - q.length()) - 1;
      if (room < 1 || drafters >= opt.speculative_max_batch) continue;
      int want = std::min(opt.speculative_tokens, room);
      while (want > 0 && !sched->grow(q, q.length() + want)) --want;
      if (want == 0) continue;
      const auto& exp = expected[q.id].tokens;
      q.draft.clear();
      for (int j = 0; j < want; ++j) {
        const size_t o = q.output.size() + size_t(j);
        q.draft.push_back(draw(2) && o < exp.size() ? exp[o] : int32_t(draw(kVocab)));
      }
      ++drafters;
    }
  }

  // Engine::Impl::step: with overlap, the next step is planned and launched before the one in flight completes.
  bool step() {
    bool worked = false;
    if (launched && (launched->needs_tokens || !overlap || opt.speculative_tokens > 0))
      complete(std::move(launched)), worked = true;
    Plan plan = sched->plan();
    std::unique_ptr<Flight> before = std::move(launched);
    in_flight = before.get();
    if (!plan.empty()) launched = launch(std::move(plan)), worked = true;
    in_flight = nullptr;
    if (before) complete(std::move(before)), worked = true;
    return worked;
  }
};

struct Totals {
  int64_t preemptions = 0, cached_tokens = 0, shared_reads = 0, state_restores = 0, frame_moves = 0, drafted = 0,
          confirmed = 0, beside_moves = 0;
};

// One random configuration and workload; adds its counts to t.
void run_seed(uint64_t seed, Totals& t) {
  std::mt19937_64 rng(seed);
  auto U = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Sim sim;
  sim.opt.page_size = 1 << U(0, 3);
  sim.opt.num_pages = U(2, 12);
  sim.opt.max_batch_size = U(1, 6);
  sim.opt.max_num_batched_tokens = U(1, 24);
  const int capacity = sim.opt.num_pages * sim.opt.page_size;
  sim.opt.max_model_len = U(2, capacity + 1 + U(0, 5));
  sim.overlap = U(0, 3) != 0;
  sim.opt.prefix_caching = U(0, 3) != 0;
  sim.opt.has_state = U(0, 1);
  sim.opt.state_snapshots = U(0, 3);
  sim.slot_state.assign(size_t(sim.opt.max_batch_size), StateTag{});
  sim.snapshot_state.assign(size_t(sim.opt.state_snapshots), StateTag{});
  if (U(0, 2) == 0) {  // speculation (the engine completes each step before planning the next)
    sim.opt.speculative_tokens = U(1, 3);
    sim.opt.speculative_max_batch = U(1, 3);
    sim.opt.kept_slot0 = 0;
    sim.draft_rng = seed * 2 + 1;
  }
  sim.sched = std::make_unique<Scheduler>(sim.opt);
  sim.kv.assign(size_t(capacity + sim.opt.page_size), RowTag{});
  if (U(0, 2) == 0) {  // a host tier: the engine's frames for this pool (kv/tiers.h)
    const int reserve = (sim.opt.max_num_batched_tokens + sim.opt.page_size - 1) / sim.opt.page_size +
                        2 * sim.opt.max_batch_size;  // Engine::Impl::step_pages
    sim.device_frames = U(reserve, reserve + sim.opt.num_pages);
    const int host = std::max(1, sim.opt.num_pages + reserve - sim.device_frames + U(0, 3));
    const int staging = U(0, 1) * U(1, 5);
    sim.host0 = sim.device_frames + 1 + staging;
    sim.tiers = std::make_unique<TierMap>(sim.device_frames, host, sim.opt.num_pages, false, staging);
    sim.sched->pool().track_drops();
    sim.kv.assign(size_t(sim.host0 + host) * sim.opt.page_size, RowTag{});
  }
  const int requests = U(1, 40);
  // Prompts start with a prefix of one of a few shared sequences half of the time (a system prompt, a
  // conversation's earlier turns), then go on at random.
  std::vector<std::vector<int32_t>> families(3);
  for (auto& f : families)
    for (int i = 0; i < capacity; ++i) f.push_back(U(0, kVocab - 1));
  const bool cancels = U(0, 1);
  int submitted = 0, idle_steps = 0;
  int64_t next_id = 1;
  for (int it = 0; it < 200000 && !g_failed; ++it) {
    while (submitted < requests && U(0, 3) == 0) {  // arrivals, sized up to the limits the engine accepts
      ++submitted;
      const int limit = std::min(sim.opt.max_model_len, capacity + 1);
      const int prompt_len = U(0, 1) ? U(1, std::max(1, (limit - 1) / 4)) : U(1, std::max(1, limit - 1));
      const int max_tokens = U(0, 1) ? std::max(1, limit - prompt_len - U(0, 2)) : U(1, std::max(1, limit - prompt_len));
      if (prompt_len + max_tokens > sim.opt.max_model_len || prompt_len + max_tokens - 1 > capacity) continue;
      auto r = std::make_unique<Request>();
      r->id = next_id++;
      // The tokens a prompt starts with: a shared sequence's, or an earlier request's prompt (the same prompt
      // again) or its prompt and expected output (the next turn of a conversation), or none.
      std::vector<int32_t> lead = families[size_t(U(0, 2))];
      const int kind = U(0, 5);
      if (kind >= 4 && !sim.prompts.empty()) {
        const int64_t earlier = int64_t(U(1, int(sim.prompts.size())));
        lead = sim.prompts[earlier];
        if (kind == 5) lead.insert(lead.end(), sim.expected[earlier].tokens.begin(), sim.expected[earlier].tokens.end());
      }
      const int shared = kind == 4 ? prompt_len : U(0, 1) ? U(0, prompt_len) : 0;
      for (int i = 0; i < prompt_len; ++i)
        r->prompt.push_back(i < shared && i < int(lead.size()) ? lead[size_t(i)] : U(0, kVocab - 1));
      r->opts.max_tokens = max_tokens;
      r->opts.min_tokens = U(0, 2) == 0 ? U(0, max_tokens) : 0;
      r->opts.ignore_eos = U(0, 1);
      r->opts.eos_token_ids = {kEos};
      if (U(0, 1)) r->opts.stop_token_ids = {kStopToken};
      if (U(0, 4) == 0) sim.penalized.insert(r->id);
      sim.prompts[r->id] = r->prompt;
      sim.expected[r->id] = run_alone(r->prompt, r->opts, sim.opt.max_model_len);
      std::vector<int32_t> all = r->prompt;
      all.insert(all.end(), sim.expected[r->id].tokens.begin(), sim.expected[r->id].tokens.end());
      sim.contexts[r->id] = prefix_hashes(all);
      sim.sched->add(std::move(r));
    }
    if (cancels && U(0, 49) == 0) {  // a cancel as the engine's loop applies it, before planning
      const auto all = sim.sched->all_requests();
      if (!all.empty()) {
        Request* r = all[size_t(U(0, int(all.size()) - 1))];
        sim.finish(sim.sched->remove(r), Finish::Cancelled);
      }
    }
    if (sim.sched->idle() && !sim.launched) {
      if (submitted >= requests) break;
      continue;
    }
    idle_steps = sim.step() ? 0 : idle_steps + 1;
    if (idle_steps > 1000) FAIL("stuck: %d running, %d waiting, nothing planned", sim.sched->running(), sim.sched->waiting());
  }
  if (!g_failed) {
    if (!sim.sched->idle() || sim.launched) FAIL("not idle at the end");
    if (sim.sched->free_pages() != sim.sched->total_pages()) FAIL("%d of %d pages free at the end", sim.sched->free_pages(), sim.sched->total_pages());
    if (sim.sched->free_slots() != sim.opt.max_batch_size) FAIL("slots held at the end");
    for (const auto& [id, want] : sim.expected) {
      const auto& got = sim.published[id];
      if (!sim.ended.count(id)) {
        FAIL("request %lld never ended", (long long)id);
      } else if (sim.ended[id] == Finish::Cancelled) {
        if (got.size() > want.tokens.size() || !std::equal(got.begin(), got.end(), want.tokens.begin()))
          FAIL("cancelled request %lld: its tokens are not a prefix of its run alone", (long long)id);
      } else if (got != want.tokens || sim.ended[id] != want.finish) {
        FAIL("request %lld: %zu tokens (finish %d), alone %zu (finish %d)", (long long)id, got.size(),
             int(sim.ended[id]), want.tokens.size(), int(want.finish));
      }
    }
    if (!std::is_sorted(sim.admission_order.begin(), sim.admission_order.end())) FAIL("admitted out of arrival order");
    if (!sim.opt.prefix_caching && (sim.shared_reads || sim.sched->cached_tokens() || sim.sched->cached_pages()))
      FAIL("the prefix cache is off, yet %lld rows were read from other requests' pages", (long long)sim.shared_reads);
  }
  if (g_failed)
    std::printf("seed %llu: page_size %d, pages %d, max_batch_size %d, budget %d, max_model_len %d, overlap %d, "
                "prefix caching %d, state %d, snapshots %d\n",
                (unsigned long long)seed, sim.opt.page_size, sim.opt.num_pages, sim.opt.max_batch_size,
                sim.opt.max_num_batched_tokens, sim.opt.max_model_len, int(sim.overlap), int(sim.opt.prefix_caching),
                int(sim.opt.has_state), sim.opt.state_snapshots);
  t.preemptions += sim.sched->preemptions();
  t.cached_tokens += sim.sched->cached_tokens();
  t.shared_reads += sim.shared_reads;
  t.state_restores += sim.state_restores;
  t.frame_moves += sim.frame_moves;
  t.beside_moves += sim.beside_moves;
  t.drafted += sim.drafted;
  t.confirmed += sim.confirmed;
}

}  // namespace

int main(int argc, char** argv) {
  const int seeds = argc > 1 ? std::atoi(argv[1]) : 2000;
  Totals t;
  for (int seed = 0; seed < seeds && !g_failed; ++seed) run_seed(uint64_t(seed), t);
  if (g_failed) return 1;
  std::printf("ok (%lld preemptions, %lld prompt tokens from the prefix cache, %lld rows read from pages another "
              "request wrote, %lld states restored from snapshots, %lld frames moved between KV tiers, %lld draft "
              "tokens fed, %lld confirmed, %lld frames moved beside the step in flight)\n",
              (long long)t.preemptions, (long long)t.cached_tokens, (long long)t.shared_reads,
              (long long)t.state_restores, (long long)t.frame_moves, (long long)t.drafted, (long long)t.confirmed,
              (long long)t.beside_moves);
  return 0;
}
