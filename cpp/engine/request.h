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
};

struct Request {
  int64_t id = 0;
  std::vector<int32_t> prompt;
  SamplingOptions opts;
  uint64_t seed = 0;
  std::vector<int32_t> output;
  std::map<int32_t, int32_t> output_counts;  // for presence/frequency penalties
  int slot = -1;
  int computed = 0;   // tokens whose K/V are in the cache
  int preempted = 0;  // times preempted
  bool cancel = false;

  int length() const { return int(prompt.size() + output.size()); }
  int32_t token_at(int i) const { return i < int(prompt.size()) ? prompt[i] : output[i - prompt.size()]; }
};

}  // namespace qrt
