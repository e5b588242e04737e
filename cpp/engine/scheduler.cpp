#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace qrt {

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::None: return "";
    case Finish::Stop: return "stop";
    case Finish::Length: return "length";
    case Finish::Cancelled: return "cancelled";
    case Finish::Error: return "error";
  }
  return "";
}

Scheduler::Scheduler(const SchedulerOptions& o)
    : opt_(o), pool_(o.num_pages, o.page_size), slots_(o.max_batch_size),
      snapshots_(o.has_state && o.prefix_caching ? o.state_snapshots : 0) {}

void Scheduler::add(std::unique_ptr<Request> r) { waiting_.push_back(std::move(r)); }

std::vector<Request*> Scheduler::all_requests() {
  std::vector<Request*> v;
  for (auto& r : running_) v.push_back(r.get());
  for (auto& r : waiting_) v.push_back(r.get());
  return v;
}

int Scheduler::pages_for(int tokens) const { return (tokens + opt_.page_size - 1) / opt_.page_size; }

int Scheduler::expected_growth(const Request& r) const {
  const int held = r.slot >= 0 ? int(slots_[r.slot].pages.size()) : 0;
  const int remaining = std::max(0, r.opts.max_tokens - int(r.output.size()));
  const int tokens = std::min(opt_.max_model_len, r.length() + int(std::ceil(reserve_ratio_ * remaining)));
  return std::max(0, pages_for(tokens) - std::max(held, pages_for(r.length())));
}

bool Scheduler::ensure_pages(Request& r, int tokens) {
  Slot& s = slots_[r.slot];
  const int need = pages_for(tokens);
  if (need - int(s.pages.size()) > pool_.free_count()) return false;
  while (int(s.pages.size()) < need) s.pages.push_back(pool_.alloc());
  return true;
}

bool Scheduler::page_tokens(const Request& r, int j, std::vector<int32_t>& tokens) const {
  const int ps = opt_.page_size;
  tokens.resize(size_t(ps));
  for (int i = 0; i < ps; ++i) {
    tokens[size_t(i)] = r.token_at(j * ps + i);
    if (tokens[size_t(i)] == kPending) return false;
  }
  return true;
}

std::vector<int> Scheduler::cached_prefix(const Request& r) const {
  std::vector<int> hit;
  if (!opt_.prefix_caching) return hit;
  std::vector<int32_t> tokens;
  // Never the page of the last token: a step must compute that token (its logits give the next one).
  for (int j = 0; (j + 1) * opt_.page_size <= r.length() - 1 && page_tokens(r, j, tokens); ++j) {
    const int page = pool_.lookup(hit.empty() ? -1 : hit.back(), tokens.data());
    if (page < 0) break;
    hit.push_back(page);
  }
  return hit;
}

void Scheduler::name_pages(Request& r, int upto) {
  if (!opt_.prefix_caching) return;
  Slot& s = slots_[r.slot];
  std::vector<int32_t> tokens;
  while (!s.naming_stopped && (s.named + 1) * opt_.page_size <= upto) {
    const int j = s.named;
    if (!page_tokens(r, j, tokens)) return;  // named once the token is known
    // Where another page holds this content already (requests that computed one prefix side by side), the
    // prefix goes on from that page: what follows is still found. That page is not held by this request, so its
    // content may go (its generation changes) before the next page is full: naming stops there.
    const int tail = pool_.name(s.pages[size_t(j)], s.named_tail, s.named_tail_gen, tokens.data());
    if (tail < 0) {
      s.naming_stopped = true;
      return;
    }
    s.named_tail = tail;
    s.named_tail_gen = pool_.generation(tail);
    ++s.named;
  }
}

bool Scheduler::snapshot_boundary(const Request& r, int pos) const {
  if (snapshots_.capacity() == 0 || pos <= 0) return false;
  return pos == (int(r.prompt.size()) - 1) / opt_.page_size * opt_.page_size || pos == r.shared_end;
}

int Scheduler::cut_at_boundary(const Request& r, int first, int n) const {
  for (int b : {r.shared_end, (int(r.prompt.size()) - 1) / opt_.page_size * opt_.page_size})
    if (snapshot_boundary(r, b) && first < b && b < first + n) n = b - first;
  return n;
}

int Scheduler::snapshot_after(const Request& r, int first, int n) {
  if (!snapshot_boundary(r, first + n)) return -1;
  // Named by the page whose name the content there has: the cached page r's match ended with (r's own page of the
  // same content stays unnamed), else r's own page (named once filled).
  if (first + n == r.shared_end) return snapshots_.take(r.shared_page, r.shared_gen);
  const int page = slots_[r.slot].pages[size_t((first + n) / opt_.page_size - 1)];
  return snapshots_.take(page, pool_.generation(page));
}

void Scheduler::preempt(Request* r) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](auto& p) { return p.get() == r; });
  QRT_CHECK(it != running_.end(), "preempt: request not running");
  std::unique_ptr<Request> own = std::move(*it);
  running_.erase(it);
  own->draft.clear();  // guessed for a position it will not decode from next
  name_pages(*own, own->computed);  // cached: its recomputation takes them back if nothing reused them
  slots_.release(own->slot, pool_);
  own->slot = -1;
  own->computed = 0;
  own->preempted++;
  preemptions_++;
  reserve_ratio_ = std::min(1.0, reserve_ratio_ + kReserveStep);  // admitted too much: expect more growth
  waiting_.push_front(std::move(own));
}

void Scheduler::launched(Plan& p) {
  int row = 0;
  for (auto& s : p.seqs) {
    Request& q = *s.req;
    q.computed = s.first + s.count;  // with a draft: until accepted() says how much of it stands
    if (!s.sample) continue;
    s.out_index = int(q.output.size());
    q.output.push_back(kPending);
    row += s.rows();
    q.pending_row = row - 1;
    q.finishing = int(q.output.size()) >= q.opts.max_tokens || q.length() >= opt_.max_model_len;
  }
}

Finish Scheduler::sampled(const PlannedSeq& s, int row, int32_t token) {
  Request& q = *s.req;
  if (q.pending_row == row && s.out_index == int(q.output.size()) - 1) q.pending_row = -1;
  return take_token(q, s.out_index, token);
}

Finish Scheduler::accepted(const PlannedSeq& s, const std::vector<int32_t>& tokens, int* taken) {
  Request& q = *s.req;
  QRT_CHECK(!tokens.empty() && tokens.size() <= 1 + s.draft.size() && s.out_index == int(q.output.size()) - 1,
            "accepted: tokens do not fit the sequence's draft");
  q.pending_row = -1;
  Finish f = Finish::None;
  int i = 0;
  for (; i < int(tokens.size()) && f == Finish::None; ++i) {
    if (i > 0) q.output.push_back(tokens[size_t(i)]);
    f = take_token(q, s.out_index + i, tokens[size_t(i)]);
  }
  // Its K/V stand for its last token and the draft tokens the samples confirmed, as far as it took them (a request
  // that ends inside its draft names no page past its output).
  q.computed = s.first + i;
  *taken = i;
  return f;
}

Finish Scheduler::take_token(Request& q, int out_index, int32_t token) {
  q.output[size_t(out_index)] = token;
  q.output_counts[token]++;
  const SamplingOptions& o = q.opts;
  const int produced = out_index + 1;
  auto has = [token](const std::vector<int32_t>& v) { return std::find(v.begin(), v.end(), token) != v.end(); };
  if ((has(o.stop_token_ids) || (!o.ignore_eos && has(o.eos_token_ids))) && produced >= o.min_tokens)
    return Finish::Stop;
  if (produced >= o.max_tokens || int(q.prompt.size()) + produced >= opt_.max_model_len) return Finish::Length;
  return Finish::None;
}

std::unique_ptr<Request> Scheduler::remove(Request* r) {
  std::unique_ptr<Request> own;
  auto it = std::find_if(running_.begin(), running_.end(), [&](auto& p) { return p.get() == r; });
  if (it != running_.end()) {
    own = std::move(*it);
    running_.erase(it);
  } else {
    auto wt = std::find_if(waiting_.begin(), waiting_.end(), [&](auto& p) { return p.get() == r; });
    QRT_CHECK(wt != waiting_.end(), "remove: unknown request");
    own = std::move(*wt);
    waiting_.erase(wt);
  }
  if (own->slot >= 0) {
    name_pages(*own, own->computed);
    slots_.release(own->slot, pool_);
  }
  own->slot = -1;
  return own;
}

Plan Scheduler::plan() {
  Plan p;
  snapshots_.ready();  // those the last plan took are written by the time this step runs
  int budget = opt_.max_num_batched_tokens;
  const int ps = opt_.page_size;
  int drafting = 0;  // sequences of this step that feed a draft
  // Running requests first, oldest first: decodes and unfinished prefills.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request* r = running_[i].get();
    if (r->finishing) {  // its last token is being sampled
      ++i;
      continue;
    }
    int n = cut_at_boundary(*r, r->computed, std::min(r->length() - r->computed, budget));
    // Speculation: a decoding request feeds its draft after its last token, as far as the budget, its limits,
    // the step's drafting sequences and the free pages allow.
    std::vector<int32_t> draft = std::move(r->draft);
    r->draft.clear();
    const bool decoding = r->length() - r->computed == 1;
    int d = 0;
    if (decoding && !draft.empty() && drafting < opt_.speculative_max_batch) {
      d = std::min({int(draft.size()), budget - 1, r->opts.max_tokens - int(r->output.size()) - 1,
                    opt_.max_model_len - r->length() - 1});
      d = std::max(d, 0);
      if (d > 0 && !ensure_pages(*r, r->computed + 1 + d)) d = 0;
    }
    draft.resize(size_t(d));
    n += d;
    // Tokens that fit in the pages the slot has plus the free ones.
    const int cap = (int(slots_[r->slot].pages.size()) + pool_.free_count()) * ps - r->computed;
    if (cap < n && cap >= 1 && n > 1) n = cap;  // a prefill chunk shrinks to what fits
    if (!ensure_pages(*r, r->computed + n)) {
      // The newest request that is not finishing (possibly r itself): one whose last token is being sampled
      // frees its pages at the end of that step anyway.
      auto victim = std::find_if(running_.rbegin(), running_.rend(), [](auto& q) { return !q->finishing; });
      if (victim->get() == r && std::any_of(running_.begin(), running_.end(), [](auto& q) { return q->finishing; })) {
        ++i;  // r would evict itself (all its K/V to recompute); a finishing request frees pages after this step
        continue;
      }
      preempt(victim->get());
      continue;  // retry r (or stop if r was the last)
    }
    // Pages that steps before this one filled: a request admitted below may read them in this step.
    name_pages(*r, r->computed);
    p.seqs.push_back({r, r->computed, n, r->computed + n >= r->length()});
    PlannedSeq& ps_ = p.seqs.back();
    ps_.snapshot = snapshot_after(*r, r->computed, n);
    if (d > 0) {
      ps_.draft = std::move(draft);
      if (opt_.has_state) ps_.keep = opt_.kept_slot0 + drafting * opt_.speculative_tokens;
      ++drafting;
    }
    budget -= n;
    ++i;
  }
  // Admit waiting requests while slots, pages and budget allow, and while the pages left cover what the
  // running requests are expected to grow by (admission control: without it the newest requests are
  // preempted and readmitted over and over once outputs grow).
  reserve_ratio_ = std::max(kMinReserveRatio, reserve_ratio_ - kReserveDecay);
  int reserved = 0;
  for (auto& r : running_) reserved += expected_growth(*r);
  while (budget > 0 && !waiting_.empty() && !waiting_.front()->finishing && slots_.free_count() > 0 &&
         pool_.free_count() > 0 && int(running_.size()) < opt_.max_batch_size) {
    Request* r = waiting_.front().get();
    std::vector<int> hit = cached_prefix(*r);
    int restore = -1;  // state models: a hit ends where a snapshot of the state was taken
    if (opt_.has_state) {
      r->shared_end = int(hit.size()) * ps;
      r->shared_page = hit.empty() ? -1 : hit.back();
      r->shared_gen = hit.empty() ? 0u : pool_.generation(hit.back());
      while (!hit.empty() && (restore = snapshots_.find(hit.back(), pool_.generation(hit.back()))) < 0) hit.pop_back();
    }
    int shared = 0;  // hit pages other requests hold: they cost no free page
    for (int page : hit) shared += pool_.holders(page) > 0;
    const int need = pages_for(r->length()) + expected_growth(*r) - shared;
    const int free_after_hit = pool_.free_count() - (int(hit.size()) - shared);
    if ((!running_.empty() && pool_.free_count() - reserved < need) || free_after_hit < 1) break;
    // Synthetic prefill: the context but its last token stands in (no hit is looked up: prefix caching is off).
    const int start = opt_.synthetic_prefill ? r->length() - 1 : int(hit.size()) * ps;
    int n = cut_at_boundary(*r, start, std::min({r->length() - start, budget, free_after_hit * ps}));
    r->slot = slots_.acquire();
    Slot& slot = slots_[r->slot];
    for (int page : hit) pool_.retain(page);
    slot.pages = hit;
    slot.named = int(hit.size());
    slot.named_tail = hit.empty() ? -1 : hit.back();
    slot.named_tail_gen = hit.empty() ? 0u : pool_.generation(hit.back());
    r->computed = start;
    if (!opt_.synthetic_prefill) {
      cached_tokens_ += start;
      if (r->preempted == 0) r->cached = start;
    }
    ensure_pages(*r, start + n);
    reserved += need - (int(slot.pages.size()) - shared);  // the pages it took left the free count already
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    p.seqs.push_back({r, start, n, start + n == r->length()});
    p.seqs.back().restore = restore;
    p.seqs.back().snapshot = snapshot_after(*r, start, n);
    p.seqs.back().zero_state = opt_.synthetic_prefill && opt_.has_state;
    budget -= n;
  }
  if (!p.seqs.empty()) build_input(p);
  return p;
}

void Scheduler::build_input(Plan& p) {
  StepInput& in = p.input;
  const int ps = opt_.page_size;
  int max_pages = 0;
  for (auto& s : p.seqs) max_pages = std::max(max_pages, pages_for(s.first + s.count));
  in.max_pages = max_pages;
  in.q_start.push_back(0);
  for (auto& s : p.seqs) {
    const Slot& slot = slots_[s.req->slot];
    const int len = s.req->length();
    for (int i = s.first; i < s.first + s.count; ++i) {
      const int32_t t = i < len ? s.req->token_at(i) : s.draft[size_t(i - len)];
      in.tokens.push_back(t == kPending ? 0 : t);
      in.token_src.push_back(t == kPending ? s.req->pending_row : -1);
      in.positions.push_back(i);
      in.kv_rows.push_back(slot.pages[i / ps] * ps + i % ps);
    }
    in.q_start.push_back(int32_t(in.tokens.size()));
    in.ctx_len.push_back(s.first + s.count);
    in.slots.push_back(s.req->slot);
    for (int j = 0; j < max_pages; ++j) in.page_table.push_back(j < int(slot.pages.size()) ? slot.pages[j] : 0);
    for (int r = s.rows(); r > 0; --r) in.logit_rows.push_back(int32_t(in.tokens.size()) - r);
    if (opt_.speculative_tokens > 0 && opt_.has_state) in.keep.push_back(s.keep);
    in.max_q_len = std::max(in.max_q_len, s.count);
    in.max_ctx_len = std::max(in.max_ctx_len, s.first + s.count);
  }
}

}  // namespace qrt
