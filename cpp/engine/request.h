// Request: one prompt and its sampling parameters, from submit to finish.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace qrt {

struct SamplingOptions {
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int64_t seed = -1;            // -1: derived from the engine seed and the request id
  int max_tokens = 16;
  int min_tokens = 0;
  int logprobs = 0;             // top-N logprobs per token
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  std::vector<int32_t> eos_token_ids;
  bool speculative = true;      // drafts from the MTP head when the engine speculates (and no penalty is set)
  // Repetition, presence or frequency penalties: the sampling reads the output's tokens.
  bool penalized() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
};

enum class Finish { None, Stop, Length, Cancelled, Error };
const char* finish_name(Finish f);

// What a request produced since the consumer last looked.
struct RequestOutput {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;      // [tokens] logprob of each token
  std::vector<int32_t> top_ids;     // [tokens * top_n]
  std::vector<float> top_logprobs;  // [tokens * top_n]
  int top_n = 0;
  Finish finish = Finish::None;
  std::string error;
  int cached_tokens = 0;  // prompt tokens whose K/V the prefix cache gave at the request's first admission
};

// While a step is in flight, the token it samples for a request is already in `output` as kPending (the
// next step can be planned and feed it from device memory, StepInput::token_src); it becomes the real
// token when the step's results arrive.
constexpr int32_t kPending = -1;

struct Request {
  int64_t id = 0;
  std::vector<int32_t> prompt;
  SamplingOptions opts;
  uint64_t seed = 0;
  std::vector<int32_t> output;               // may end with kPending
  std::map<int32_t, int32_t> output_counts;  // of known output tokens, for presence/frequency penalties
  int slot = -1;
  int computed = 0;         // tokens whose K/V are in the cache (or being written by a launched step)
  int preempted = 0;        // times preempted
  int cached = 0;           // prompt tokens the prefix cache gave at the first admission (not computed)
  int shared_end = 0;       // state models: where the prompt's K/V match with the cache ended at admission (its
                            // state is snapshotted there on the way, for the next request with that prefix),
  int shared_page = -1;     // and the cached page that ends the match (a snapshot there is named by it), with
  uint32_t shared_gen = 0;  // its generation then
  int pending_row = -1;     // row of the in-flight step's sampling that gives output.back() (when kPending)
  bool finishing = false;   // the pending token is its last (length limit): nothing more to plan
  bool finished = false;    // finished or cancelled; kept alive only while an in-flight step refers to it
  std::vector<int32_t> draft;  // speculation: tokens guessed to follow its last one, fed (and verified) next step
  // Speculation's running share of this request's draft tokens that stood (each verified step weighs 1/4), and the
  // steps it decodes plainly before drafting again once that share fell below speculative_min_acceptance.
  float draft_acceptance = 1.0f;
  int plain_steps = 0;

  int length() const { return int(prompt.size() + output.size()); }
  int32_t token_at(int i) const { return i < int(prompt.size()) ? prompt[i] : output[i - prompt.size()]; }
};

}  // namespace qrt
