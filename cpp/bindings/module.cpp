// The native module qwen_rt._core: the Engine handle, its option structs, and the op harness used by tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "backend/ops.h"
#include "dist/comm.h"
#include "engine/engine.h"
#include "model/footprint.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace qrt {
void bind_op_harness(nb::module_& m);
}

NB_MODULE(_core, m) {
  using namespace qrt;
  m.doc() = "qwen_rt native runtime";

  nb::class_<ModelConfig>(m, "ModelConfig")
      .def(nb::init<>())
      .def_rw("arch", &ModelConfig::arch)
      .def_rw("vocab_size", &ModelConfig::vocab_size)
      .def_rw("hidden_size", &ModelConfig::hidden_size)
      .def_rw("num_layers", &ModelConfig::num_layers)
      .def_rw("num_q_heads", &ModelConfig::num_q_heads)
      .def_rw("num_kv_heads", &ModelConfig::num_kv_heads)
      .def_rw("head_dim", &ModelConfig::head_dim)
      .def_rw("intermediate_size", &ModelConfig::intermediate_size)
      .def_rw("rms_eps", &ModelConfig::rms_eps)
      .def_rw("tie_embeddings", &ModelConfig::tie_embeddings)
      .def_rw("attn_bias", &ModelConfig::attn_bias)
      .def_rw("qk_norm", &ModelConfig::qk_norm)
      .def_rw("zero_centred_norms", &ModelConfig::zero_centred_norms)
      .def_rw("attn_output_gate", &ModelConfig::attn_output_gate)
      .def_rw("layer_types", &ModelConfig::layer_types)
      .def_rw("mtp_layers", &ModelConfig::mtp_layers)
      .def_rw("linear_k_heads", &ModelConfig::linear_k_heads)
      .def_rw("linear_v_heads", &ModelConfig::linear_v_heads)
      .def_rw("linear_k_dim", &ModelConfig::linear_k_dim)
      .def_rw("linear_v_dim", &ModelConfig::linear_v_dim)
      .def_rw("linear_conv_kernel", &ModelConfig::linear_conv_kernel)
      .def_rw("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_rw("rope_inv_freq", &ModelConfig::rope_inv_freq)
      .def_rw("rope_attention_factor", &ModelConfig::rope_attention_factor)
      .def_rw("weight_prefix", &ModelConfig::weight_prefix)
      .def_rw("fp8_scales", &ModelConfig::fp8_scales)
      .def_rw("fp8_scale_name", &ModelConfig::fp8_scale_name)
      .def_rw("fp8_online", &ModelConfig::fp8_online)
      .def_rw("fp8_skip", &ModelConfig::fp8_skip);

  nb::class_<TensorSource>(m, "TensorSource")
      .def(nb::init<>())
      .def("__init__",
           [](TensorSource* t, std::string name, std::string path, int64_t offset, int64_t nbytes, std::string dtype,
              std::vector<int64_t> shape) {
             new (t) TensorSource{std::move(name), std::move(path), offset, nbytes, std::move(dtype), std::move(shape)};
           },
           "name"_a, "path"_a, "offset"_a, "nbytes"_a, "dtype"_a, "shape"_a)
      .def_rw("name", &TensorSource::name)
      .def_rw("path", &TensorSource::path)
      .def_rw("offset", &TensorSource::offset)
      .def_rw("nbytes", &TensorSource::nbytes)
      .def_rw("dtype", &TensorSource::dtype)
      .def_rw("shape", &TensorSource::shape);

  nb::class_<EngineOptions>(m, "EngineOptions")
      .def(nb::init<>())
      .def_rw("device", &EngineOptions::device)
      .def_rw("device_index", &EngineOptions::device_index)
      .def_rw("weight_dtype", &EngineOptions::weight_dtype)
      .def_rw("act_dtype", &EngineOptions::act_dtype)
      .def_rw("kv_cache_dtype", &EngineOptions::kv_cache_dtype)
      .def_rw("max_batch_size", &EngineOptions::max_batch_size)
      .def_rw("max_model_len", &EngineOptions::max_model_len)
      .def_rw("max_num_batched_tokens", &EngineOptions::max_num_batched_tokens)
      .def_rw("page_size", &EngineOptions::page_size)
      .def_rw("kv_cache_memory", &EngineOptions::kv_cache_memory)
      .def_rw("kv_offload_memory", &EngineOptions::kv_offload_memory)
      .def_rw("gpu_memory_utilization", &EngineOptions::gpu_memory_utilization)
      .def_rw("tensor_parallel_size", &EngineOptions::tensor_parallel_size)
      .def_rw("comm", &EngineOptions::comm)
      .def_rw("dummy_weights", &EngineOptions::dummy_weights)
      .def_rw("seed", &EngineOptions::seed)
      .def_rw("num_threads", &EngineOptions::num_threads)
      .def_rw("cuda_graphs", &EngineOptions::cuda_graphs)
      .def_rw("comm_timeout_s", &EngineOptions::comm_timeout_s)
      .def_rw("state_snapshots", &EngineOptions::state_snapshots)
      .def_rw("prefix_caching", &EngineOptions::prefix_caching)
      .def_rw("check_weights", &EngineOptions::check_weights)
      .def_rw("sparse_budget_tokens", &EngineOptions::sparse_budget_tokens)
      .def_rw("sparse_sink_tokens", &EngineOptions::sparse_sink_tokens)
      .def_rw("sparse_window_tokens", &EngineOptions::sparse_window_tokens)
      .def_rw("kv_staging_pages", &EngineOptions::kv_staging_pages)
      .def_rw("speculative_tokens", &EngineOptions::speculative_tokens)
      .def_rw("speculative_max_batch", &EngineOptions::speculative_max_batch)
      .def_rw("speculative_min_acceptance", &EngineOptions::speculative_min_acceptance)
      .def_rw("speculative_pause_steps", &EngineOptions::speculative_pause_steps)
      .def_rw("synthetic_prefill", &EngineOptions::synthetic_prefill);

  nb::class_<SamplingOptions>(m, "SamplingOptions")
      .def(nb::init<>())
      .def_rw("temperature", &SamplingOptions::temperature)
      .def_rw("top_k", &SamplingOptions::top_k)
      .def_rw("top_p", &SamplingOptions::top_p)
      .def_rw("min_p", &SamplingOptions::min_p)
      .def_rw("repetition_penalty", &SamplingOptions::repetition_penalty)
      .def_rw("presence_penalty", &SamplingOptions::presence_penalty)
      .def_rw("frequency_penalty", &SamplingOptions::frequency_penalty)
      .def_rw("seed", &SamplingOptions::seed)
      .def_rw("max_tokens", &SamplingOptions::max_tokens)
      .def_rw("min_tokens", &SamplingOptions::min_tokens)
      .def_rw("logprobs", &SamplingOptions::logprobs)
      .def_rw("ignore_eos", &SamplingOptions::ignore_eos)
      .def_rw("stop_token_ids", &SamplingOptions::stop_token_ids)
      .def_rw("eos_token_ids", &SamplingOptions::eos_token_ids)
      .def_rw("speculative", &SamplingOptions::speculative);

  nb::class_<RequestOutput>(m, "RequestOutput")
      .def_ro("tokens", &RequestOutput::tokens)
      .def_ro("logprobs", &RequestOutput::logprobs)
      .def_ro("top_ids", &RequestOutput::top_ids)
      .def_ro("top_logprobs", &RequestOutput::top_logprobs)
      .def_ro("top_n", &RequestOutput::top_n)
      .def_ro("cached_tokens", &RequestOutput::cached_tokens)
      .def_prop_ro("finish_reason", [](const RequestOutput& o) -> nb::object {
        if (o.finish == Finish::None) return nb::none();
        return nb::str(finish_name(o.finish));
      })
      .def_ro("error", &RequestOutput::error);

  nb::class_<Engine>(m, "Engine")
      .def("__init__",
           [](Engine* self, const ModelConfig& cfg, const std::vector<TensorSource>& tensors, const EngineOptions& opts,
              nb::object progress) {
             PyObject* cb = progress.is_none() ? nullptr : progress.ptr();  // borrowed: alive during the call
             Progress fn;
             if (cb)
               fn = [cb](const std::string& what, int64_t done, int64_t total) {
                 nb::gil_scoped_acquire gil;
                 try {
                   nb::handle h(cb);
                   h(what, done, total);
                 } catch (...) {
                 }
               };
             nb::gil_scoped_release release;
             new (self) Engine(cfg, tensors, opts, fn);
           },
           "config"_a, "tensors"_a, "options"_a, "progress"_a = nb::none())
      .def("submit", &Engine::submit, "prompt"_a, "sampling"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("cancel", &Engine::cancel, "request_id"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("release", &Engine::release, "request_id"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("wait", &Engine::wait, "request_id"_a, "timeout_s"_a, "until_finished"_a = false,
           nb::call_guard<nb::gil_scoped_release>())
      .def("wait_any", &Engine::wait_any, "request_ids"_a, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("close", &Engine::close, nb::call_guard<nb::gil_scoped_release>())
      .def("stats", [](const Engine& e) {
        const EngineStats s = e.stats();
        nb::dict d;
        d["free_slots"] = s.free_slots;
        d["total_slots"] = s.total_slots;
        d["free_pages"] = s.free_pages;
        d["total_pages"] = s.total_pages;
        d["cached_pages"] = s.cached_pages;
        d["cached_tokens"] = s.cached_tokens;
        d["running"] = s.running;
        d["waiting"] = s.waiting;
        d["preemptions"] = s.preemptions;
        d["steps"] = s.steps;
        d["max_model_len"] = s.max_model_len;
        d["page_size"] = s.page_size;
        d["weight_bytes"] = s.weight_bytes;
        d["kv_bytes"] = s.kv_bytes;
        d["state_bytes"] = s.state_bytes;
        d["sparse_rows"] = s.sparse_rows;
        d["sparse_pages_attended"] = s.sparse_pages_attended;
        d["sparse_pages_held"] = s.sparse_pages_held;
        d["kv_host_bytes"] = s.kv_host_bytes;
        d["device_pages"] = s.device_pages;
        d["pages_on_device"] = s.pages_on_device;
        d["pages_on_host"] = s.pages_on_host;
        d["kv_bytes_to_host"] = s.kv_bytes_to_host;
        d["page_reads_device"] = s.page_reads_device;
        d["page_reads_host"] = s.page_reads_host;
        d["staging_pages"] = s.staging_pages;
        d["staging_reads"] = s.staging_reads;
        d["staging_copies"] = s.staging_copies;
        d["staging_in_place"] = s.staging_in_place;
        d["kv_bytes_to_device"] = s.kv_bytes_to_device;
        d["spec_drafted"] = s.spec_drafted;
        d["spec_pauses"] = s.spec_pauses;
        d["spec_accepted"] = s.spec_accepted;
        d["spec_accepted_at"] = s.spec_accepted_at;
        return d;
      });

  m.def("footprint",
        [](const ModelConfig& cfg, int ranks, const std::string& weights, const std::string& act,
           const std::string& kv, bool folds_gains, int max_tokens, int max_seqs, int max_pages_per_seq,
           int page_size) {
          FootprintShape s{ranks, parse_dtype(weights), parse_dtype(act), parse_dtype(kv), folds_gains,
                           max_tokens, max_seqs, max_pages_per_seq, page_size};
          const Footprint f = footprint(cfg, s);
          nb::dict d;
          d["weights"] = f.weights;
          d["workspace"] = f.workspace;
          d["rope_position"] = f.rope_position;
          d["kv_page"] = f.kv_page;
          d["state_slot"] = f.state_slot;
          return d;
        },
        "config"_a, "ranks"_a, "weights"_a, "act"_a, "kv"_a, "folds_gains"_a, "max_tokens"_a, "max_seqs"_a,
        "max_pages_per_seq"_a, "page_size"_a, "Bytes one rank allocates (model/footprint.h), for tests.");
  m.def("linear_modules",
        [](const ModelConfig& cfg) {
          std::vector<std::string> out;
          for_each_checkpoint_tensor(cfg, [&](const CheckpointTensor& t) {
            if (t.linear) out.push_back(t.name.substr(0, t.name.size() - 7));  // less ".weight"
          });
          return out;
        },
        "config"_a, "The decoder's linear modules, as the checkpoint names them (what may be FP8).");
  m.def("cuda_device_count", &cuda_device_count, nb::call_guard<nb::gil_scoped_release>());
  m.def("cuda_plugin_error", &cuda_plugin_error);
  m.def("cuda_unavailable_reason", &cuda_unavailable_reason, nb::call_guard<nb::gil_scoped_release>());
  m.def("set_cuda_library_dirs", &set_cuda_library_dirs);
  bind_op_harness(m);
}
