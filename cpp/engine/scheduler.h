// Scheduler: continuous batching over a fixed number of slots (host only, unit-testable).
// Each step mixes decode (one token per running request) with chunked prefill under a token budget.
// When pages run out, the newest running request is preempted (its pages freed, recomputed later).
// Admission control: a waiting request is admitted only while the free pages cover its current length
// plus the expected growth of every running request, where a request is expected to produce
// reserve_ratio of its remaining max_tokens. The ratio rises with each preemption (growth was
// underestimated) and decays a little every step (outputs often stop before max_tokens).
// Prefix caching: the full pages a request has computed are named in the pool by their tokens; a request
// admitted later whose tokens start the same way takes those pages instead of computing them again (its first
// step begins after them). A page is named only once a step before the one being planned filled it (no step
// reads rows that it also writes), and every request computes its last prompt token itself.
// Models with a recurrent state (DeltaNet layers): a state holds only where it was taken, so a prefix hit also needs
// a snapshot of the state at its end. A prompt's prefill stops at the end of its last full page (before its last
// token) and where its match with the cached pages ended (a shared system prompt: the next request with it hits),
// the states there are snapshotted, and a later request's hit is cut back to the longest one with a snapshot.
#pragma once
#include <deque>
#include <memory>
#include <vector>

#include "engine/request.h"
#include "kv/pages.h"
#include "model/step.h"

namespace qrt {

struct SchedulerOptions {
  int max_batch_size = 8;
  int max_num_batched_tokens = 2048;
  int page_size = 16;
  int num_pages = 0;
  int max_model_len = 0;
  bool prefix_caching = true;
  bool has_state = false;   // the model keeps a per-slot recurrent state (DeltaNet layers)
  int state_snapshots = 0;  // snapshots of it kept for prefix hits (has_state; 0: no prefix hits)
  // Speculation: the most draft tokens a sequence feeds, the most sequences per step that feed them, and (state
  // models) the first of the state slots where verification keeps the states to roll back to (speculative_tokens
  // per sequence; ops.h AttnBatch::keep).
  int speculative_tokens = 0;
  int speculative_max_batch = 0;
  int kept_slot0 = 0;
  // Benchmarks: a prompt's K/V but its last token's stand in as they are (random, KvCache::fill_random) and its
  // state starts from zeros; its first step computes the last token alone.
  bool synthetic_prefill = false;
};

struct PlannedSeq {
  Request* req;
  int first;          // first token index fed this step
  int count;          // tokens fed this step
  bool sample;        // the step reaches the end of the sequence: a token is sampled
  int out_index = -1; // where in req->output the sampled token goes (set when the step is launched)
  int restore = -1;   // state models: the snapshot the slot's state is copied from before the step
  int snapshot = -1;  // state models: the snapshot the slot's state is copied into after the step
  std::vector<int32_t> draft;  // speculation: the request's draft, fed after its last token (count = 1 + drafts);
                               // every row samples
  int keep = -1;      // state models with a draft: the first slot of the states kept after each row but the last
  bool zero_state = false;  // synthetic prefill: the slot's state is set to zeros before the step
  int rows() const { return sample ? 1 + int(draft.size()) : 0; }  // sampled rows
};

struct Plan {
  std::vector<PlannedSeq> seqs;
  StepInput input;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerOptions& o);
  const SchedulerOptions& options() const { return opt_; }
  void add(std::unique_ptr<Request> r);  // to the back of the waiting queue
  // Plans the next step. Requests finished (cancelled) before planning are returned by take_finished().
  Plan plan();
  // The plan's effect on its requests once it is launched, as if the step had run (the engine and the simulation
  // both call it): their K/V are (being) written, and each sequence that samples gets a pending token at out_index
  // of its output, its sampling row in pending_row; a request whose token is its last is finishing.
  void launched(Plan& p);
  // Sequence s of a launched plan sampled `token` (its sampling row: row): the token takes its place in the
  // output. Returns how the request ends with it (Finish::None: it goes on; the caller removes it otherwise).
  Finish sampled(const PlannedSeq& s, int row, int32_t token);
  // Speculation: sequence s of a launched plan, its draft verified: `tokens` (the step's samples up to and with the
  // first that differs from the draft: at most 1 + drafts) take their places in order, until one ends the request.
  // Its K/V stand up to the last fed token they confirm. Returns how the request ends (as sampled), and through
  // *taken how many of the tokens it took.
  Finish accepted(const PlannedSeq& s, const std::vector<int32_t>& tokens, int* taken);
  // Speculation: pages for r's first `tokens` tokens, from free ones only (no preemption); false when too few.
  bool grow(Request& r, int tokens) { return ensure_pages(r, tokens); }
  // The pages of r's slot (r running).
  const std::vector<int>& pages(const Request& r) const { return slots_[r.slot].pages; }
  // Removes a running or waiting request (finish or cancel) and frees its slot and pages.
  std::unique_ptr<Request> remove(Request* r);
  bool idle() const { return running_.empty() && waiting_.empty(); }
  std::vector<Request*> all_requests();
  int running() const { return int(running_.size()); }
  int waiting() const { return int(waiting_.size()); }
  int free_slots() const { return slots_.free_count(); }
  int free_pages() const { return pool_.free_count(); }
  int total_pages() const { return pool_.total(); }
  int64_t preemptions() const { return preemptions_; }
  int cached_pages() const { return pool_.cached_count(); }  // held by no request, kept for their prefix
  // Tokens whose K/V came from the cache instead of a step (a preempted request taking its own pages back too).
  int64_t cached_tokens() const { return cached_tokens_; }
  const PagePool& pool() const { return pool_; }
  PagePool& pool() { return pool_; }

 private:
  bool ensure_pages(Request& r, int tokens);  // pages for tokens [0, tokens) of r
  int pages_for(int tokens) const;
  int expected_growth(const Request& r) const;  // pages r is expected to add beyond its current length
  void preempt(Request* r);
  // Tokens of r's page j into tokens; false while one of them is pending (its value not yet known).
  bool page_tokens(const Request& r, int j, std::vector<int32_t>& tokens) const;
  std::vector<int> cached_prefix(const Request& r) const;  // pages of r's leading tokens the cache holds
  void name_pages(Request& r, int upto);  // names r's full pages within tokens [0, upto), filled by earlier steps
  // State models: where r's state is snapshotted: the end of its prompt's last full page before its last token, and
  // where its prompt's match with the cache ended at admission (0: none).
  bool snapshot_boundary(const Request& r, int pos) const;
  // A chunk of n tokens from `first`, cut to end at the first snapshot boundary it crosses; the snapshot to take
  // when a chunk ends at one.
  int cut_at_boundary(const Request& r, int first, int n) const;
  int snapshot_after(const Request& r, int first, int n);
  void build_input(Plan& p);
  Finish take_token(Request& q, int out_index, int32_t token);  // token at output[out_index]: how q ends with it

  SchedulerOptions opt_;
  PagePool pool_;
  SlotTable slots_;
  SnapshotTable snapshots_;
  std::deque<std::unique_ptr<Request>> waiting_;
  std::vector<std::unique_ptr<Request>> running_;  // admission order: the back is the newest
  int64_t preemptions_ = 0, cached_tokens_ = 0;
  static constexpr double kMinReserveRatio = 0.1, kReserveStep = 0.1, kReserveDecay = 0.001;
  double reserve_ratio_ = 0.5;
};

}  // namespace qrt
