"""Bad input raises ValueError / TypeError naming the problem, before anything runs; the
generator keeps serving correct results afterwards."""
from __future__ import annotations

import math

import pytest
import torch

import models as M
import qwen_rt

NAME = "qwen3_gqa2_tied"
MAX_LEN = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(build):
    return build(NAME)


@pytest.fixture(scope="module")
def gen(folder, make_gen):
    return make_gen(folder, max_batch_size=4, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def good(folder):
    (p,) = M.pick_prompts(folder, seed=600, lengths=[10], max_new=6)
    return p, M.hf_greedy(folder, p, 6)


def assert_still_serves(gen, good):
    p, ref = good
    s = gen.stats()
    assert s["running"] == 0 and s["waiting"] == 0, s
    (c,) = gen.generate([p], max_tokens=6, **GREEDY)
    assert c.token_ids == ref


def V(folder):
    return M.model_info(folder)["vocab_size"]


# (id, prompt maker, kwargs, exception, regex the message must match)
BAD_REQUESTS = [
    ("empty-str", lambda v: "", {}, ValueError, r"(?i)empty|prompt"),
    ("empty-ids", lambda v: [], {}, ValueError, r"(?i)empty|prompt"),
    ("empty-in-list", lambda v: [[5, 6], []], {}, ValueError, r"(?i)empty|prompt"),
    ("id-none", lambda v: [5, None], {}, TypeError, r"list of int, and holds a NoneType"),
    ("id-negative", lambda v: [5, -1, 6], {}, ValueError, r"(?i)vocab|token id|range|-1"),
    ("id-vocab", lambda v: [5, v], {}, ValueError, r"(?i)vocab|token id|range"),
    ("id-vocab-in-batch", lambda v: [[5, 6], [7, v + 100]], {}, ValueError,
     r"(?i)vocab|token id|range"),
    ("too-long", lambda v: [5] * (MAX_LEN + 1), {"max_tokens": 1}, ValueError,
     r"(?i)max_model_len|too long|length"),
    ("prompt-plus-max-tokens", lambda v: [5] * (MAX_LEN - 4), {"max_tokens": 5}, ValueError,
     r"(?i)max_model_len|max_tokens"),
    ("temperature-negative", lambda v: [5], {"temperature": -0.5}, ValueError, r"temperature"),
    ("temperature-nan", lambda v: [5], {"temperature": math.nan}, ValueError, r"temperature"),
    ("temperature-tiny", lambda v: [5], {"temperature": 1e-39}, ValueError, r"temperature"),
    ("top-p-zero", lambda v: [5], {"top_p": 0.0}, ValueError, r"top_p"),
    ("top-p-big", lambda v: [5], {"top_p": 1.5}, ValueError, r"top_p"),
    ("top-k-negative", lambda v: [5], {"top_k": -1}, ValueError, r"top_k"),
    ("min-p-big", lambda v: [5], {"min_p": 1.5}, ValueError, r"min_p"),
    ("max-tokens-negative", lambda v: [5], {"max_tokens": -1}, ValueError, r"max_tokens"),
    ("repetition-penalty-zero", lambda v: [5], {"repetition_penalty": 0.0}, ValueError,
     r"repetition_penalty"),
    ("logprobs-negative", lambda v: [5], {"logprobs": -1}, ValueError, r"logprobs"),
    ("logprobs-beyond-max", lambda v: [5], {"logprobs": 21}, ValueError, r"logprobs must be <= 20 \(the Generator's max_logprobs\)"),
    # Values Python holds but the engine's int32 / float32 cannot: refused in the library's words.
    ("top-k-int32", lambda v: [5], {"top_k": 2**31}, ValueError, r"top_k must be <= 2147483647"),
    ("max-tokens-int32", lambda v: [5], {"max_tokens": 2**40}, ValueError, r"max_tokens must be <= 2147483647"),
    ("seed-uint64", lambda v: [5], {"seed": 2**64}, ValueError, r"seed must be < 2\*\*63"),
    ("temperature-huge-int", lambda v: [5], {"temperature": 10**400}, ValueError,
     r"temperature is too large .*float32.*401 digits"),
    ("temperature-float32-inf", lambda v: [5], {"temperature": 1e39}, ValueError, r"temperature is too large .*float32"),
    ("penalty-float32-inf", lambda v: [5], {"presence_penalty": -1e39}, ValueError, r"presence_penalty .*float32"),
    ("temperature-float32-zero", lambda v: [5], {"temperature": 1e-46}, ValueError, r"temperature must be 0 \(greedy\)"),
    ("temperature-float32-minus-zero", lambda v: [5], {"temperature": -1e-46}, ValueError, r"temperature must be >= 0"),
    ("top-p-float32-zero", lambda v: [5], {"top_p": 1e-50}, ValueError, r"top_p must be > 0, got 1e-50 \(0.0 in float32\)"),
    ("unknown-keyword", lambda v: [5], {"bogus_option": 1}, TypeError, r"bogus_option"),
    ("prompt-float", lambda v: 3.5, {}, TypeError, r"(?i)prompt|float"),
    ("prompt-float-ids", lambda v: [1.0, 2.0], {}, TypeError, r"(?i)prompt|int|float"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(folder, gen, good, case):
    _, make_prompt, kw, exc, pattern = case
    prompt = make_prompt(V(folder))
    kw = dict(kw)
    kw.setdefault("max_tokens", 4)
    with pytest.raises(exc, match=pattern):
        gen.generate(prompt, **kw)
    assert_still_serves(gen, good)
    # The same problem is caught by submit() and stream() as well.
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], list):
        with pytest.raises(exc, match=pattern):
            gen.submit(prompt, **kw)
        with pytest.raises(exc, match=pattern):
            list(gen.stream(prompt, **kw))
        assert_still_serves(gen, good)


def test_bad_sampling_params_object(folder, gen, good):
    with pytest.raises(ValueError, match="temperature"):
        gen.generate([5, 6], sampling=qwen_rt.SamplingParams(temperature=-1.0, max_tokens=3))
    with pytest.raises(ValueError, match="top_p"):
        gen.generate([5, 6], sampling=qwen_rt.SamplingParams(top_p=2.0, max_tokens=3))
    assert_still_serves(gen, good)


def test_limits_are_inclusive(folder, gen, good):
    """prompt + max_tokens == max_model_len is allowed; so are temperature 0, top_p 1, top_k 0."""
    (p,) = M.pick_prompts(folder, seed=601, lengths=[MAX_LEN - 4], max_new=4)
    (c,) = gen.generate(p, max_tokens=4, **GREEDY)
    assert len(c.token_ids) == 4 and c.token_ids == M.hf_greedy(folder, p, 4)
    (c,) = gen.generate(good[0], max_tokens=6, top_p=1.0, top_k=0, min_p=0.0, **GREEDY)
    assert c.token_ids == good[1]
    assert_still_serves(gen, good)


def test_bad_chat_messages(gen, good):
    with pytest.raises(ValueError, match="message 0 has no 'role'"):
        gen.chat([{"content": "no role"}], max_tokens=3)
    with pytest.raises(ValueError, match=r"message 1 \('user'\) has no 'content'"):
        gen.chat([{"role": "system", "content": "Be brief."}, {"role": "user"}], max_tokens=3)
    with pytest.raises(ValueError, match="has no 'content'"):
        gen.chat([{"role": "user", "content": None}], max_tokens=3)
    with pytest.raises(TypeError, match="'content' must be a str"):
        gen.chat([{"role": "user", "content": 42}], max_tokens=3)
    with pytest.raises(TypeError, match="'role' must be a str"):
        gen.chat([{"role": 1, "content": "hi"}], max_tokens=3)
    with pytest.raises(TypeError, match="content parts"):
        gen.chat([{"role": "user", "content": ["hi"]}], max_tokens=3)
    with pytest.raises(TypeError):
        gen.chat("not a list of messages", max_tokens=3)
    assert_still_serves(gen, good)


def test_an_assistant_message_that_calls_tools_needs_no_content(gen):
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    template = "{% for m in messages %}{{ m.role }}: {{ m.content or m.tool_calls[0].function.name }}\n{% endfor %}"
    prompt = gen.chat_prompt([{"role": "user", "content": "1 + 2?"},
                              {"role": "assistant", "content": None, "tool_calls": calls},
                              {"role": "tool", "content": "3"}], chat_template=template)
    assert gen.tokenizer.decode(prompt) == "user: 1 + 2?\nassistant: add\ntool: 3\n"


# --- loading ------------------------------------------------------------------------------------

def _copy(folder, tmp_path):
    return M.copy_folder(folder, tmp_path / "m")


def test_unsupported_architecture(folder, tmp_path):
    f = _copy(folder, tmp_path)
    M.edit_json(f / "config.json",
                lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(ValueError, match="LlamaForCausalLM|llama"):
        qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2))


def test_missing_tensor(folder, tmp_path):
    f = _copy(folder, tmp_path)
    st = M.load_state(f)
    name = "model.layers.1.mlp.down_proj.weight"
    del st[name]
    M.save_state(f, st)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2))


def test_missing_lm_head_untied(build, tmp_path):
    f = _copy(build("qwen3_mha_untied"), tmp_path)
    st = M.load_state(f)
    del st["lm_head.weight"]
    M.save_state(f, st)
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2))


def test_wrong_shape(folder, tmp_path):
    f = _copy(folder, tmp_path)
    st = M.load_state(f)
    name = "model.layers.0.self_attn.k_proj.weight"
    w = st[name]
    st[name] = torch.cat([w, w[:1]], dim=0)  # one output row too many
    M.save_state(f, st)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2))


def test_missing_bias_qwen2(build, tmp_path):
    f = _copy(build("qwen2_bias_gqa2_tied"), tmp_path)
    st = M.load_state(f)
    name = "model.layers.0.self_attn.q_proj.bias"
    del st[name]
    M.save_state(f, st)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2))


@pytest.mark.parametrize("device", ["tpu", "cuda:abc", "cpu:x", ""])
def test_bad_device(folder, device):
    with pytest.raises(ValueError, match="(?i)device"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2, device=device))


@pytest.mark.parametrize("dtype", ["int8", "float64", "fp33"])
def test_bad_dtype(folder, dtype):
    with pytest.raises(ValueError, match="(?i)dtype|" + dtype):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2, dtype=dtype))


def test_kv_cache_memory_beyond_the_machine(folder):
    """The CPU pool is committed as it fills, so a size the machine cannot hold is refused up front."""
    with pytest.raises(ValueError, match="kv_cache_memory"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2) | {"kv_cache_memory": 1 << 60})


def test_bad_generator_arguments(folder):
    with pytest.raises(TypeError, match="bogus_option"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2), bogus_option=1)
    with pytest.raises(ValueError, match="max_batch_size"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2) | {"max_batch_size": 0})
    with pytest.raises(ValueError, match="load_format"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2, load_format="magic"))
    # Beyond the engine's int32 (uint64 for the seed): ValueError naming the limit, not nanobind's TypeError.
    for name, bad in (("max_batch_size", 2**31), ("page_size", 2**31), ("num_threads", 2**40), ("seed", 2**64),
                      ("max_model_len", 2**31), ("kv_cache_memory", 2**63)):
        with pytest.raises(ValueError, match=name):
            qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2) | {name: bad})
    for bad, err in ((0, ValueError), (float("nan"), ValueError), ("10", TypeError)):
        with pytest.raises(err, match="comm_timeout"):
            qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2), comm_timeout=bad)
    for name, bad, err in (("gpu_memory_utilization", "0.5", TypeError), ("gpu_memory_utilization", True, TypeError),
                           ("gpu_memory_utilization", 1.5, ValueError), ("cuda_graphs", "no", TypeError),
                           ("progress", 1, TypeError)):
        with pytest.raises(err, match=name):  # before anything loads
            qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2) | {name: bad})
    # On CUDA a step's sequences and tokens index grid dimensions (checked before any device is touched).
    for name in ("max_batch_size", "max_num_batched_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be <= 65535 on CUDA"):
            qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2) | {"device": "cuda", name: 70000})


def test_missing_folder_file(folder, tmp_path):
    f = _copy(folder, tmp_path)
    (f / "model.safetensors").unlink()
    with pytest.raises((ValueError, FileNotFoundError), match="(?i)safetensors|weights"):
        qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2))


def test_unset_max_tokens_stops_at_max_model_len(folder, gen, good):
    """A max_tokens the caller did not set (default 256) stops at the room the prompt leaves: finish "length",
    the same tokens as transformers; set explicitly, the same overflow is an error; an explicit min_tokens
    beyond the room is an error naming it."""
    (p,) = M.pick_prompts(folder, seed=602, lengths=[MAX_LEN - 9], max_new=9)
    (c,) = gen.generate(p, **GREEDY)
    assert c.finish_reason == "length" and c.token_ids == M.hf_greedy(folder, p, 9)
    with pytest.raises(ValueError, match="max_tokens"):
        gen.generate(p, max_tokens=10, **GREEDY)
    with pytest.raises(ValueError, match="min_tokens"):
        gen.generate(p, min_tokens=10, **GREEDY)
    assert_still_serves(gen, good)


def test_numpy_numbers_are_accepted(folder, gen, good):
    """NumPy integers and floats work wherever Python's do: token ids (in a list or an array, 1-D or 2-D) and
    sampling fields. A NumPy bool is still not an int."""
    import numpy as np
    p, ref = good
    kw = dict(max_tokens=np.int64(6), temperature=np.float32(0.0), ignore_eos=True)
    assert gen.generate([np.int64(t) for t in p], **kw)[0].token_ids == ref
    assert gen.generate(np.array(p), **kw)[0].token_ids == ref
    assert [c.token_ids for c in gen.generate(np.array([p, p]), **kw)] == [ref, ref]
    assert gen.submit(np.array(p, dtype=np.int32), **kw).result().token_ids == ref
    with pytest.raises(TypeError, match="one prompt"):
        gen.submit([np.array(p), np.array(p)], **kw)
    assert list(gen.stream([np.int32(t) for t in p], **kw))[-1].finish_reason == "length"
    with pytest.raises(TypeError, match="bool"):
        gen.generate([np.bool_(True), 3], max_tokens=2)
    with pytest.raises(TypeError, match="max_tokens"):
        gen.generate(p, max_tokens=np.float64(3.0))
    assert_still_serves(gen, good)


def test_default_max_model_len_is_capped_by_the_kv_cache(folder, good):
    """Left to its default, max_model_len is what the KV pool can hold (all of a request's tokens but its last),
    so a request that sets no max_tokens runs to the pool's end (finish "length") instead of being refused."""
    kw = M.base_kwargs(folder, max_batch_size=2, kv_cache_memory=M.kv_bytes(folder, 4, 16))
    with qwen_rt.Generator(str(folder), **kw) as g:
        assert g.max_model_len == 4 * 16 + 1
        p, ref = good
        (c,) = g.generate(p, **GREEDY)
        assert c.finish_reason == "length" and len(p) + len(c.token_ids) == 65
        assert c.token_ids[:6] == ref
    with qwen_rt.Generator(str(folder), **dict(kw, max_model_len=200)) as g:  # set by the caller: kept
        assert g.max_model_len == 200
        with pytest.raises(ValueError, match="KV cache"):
            g.generate(p, max_tokens=100, **GREEDY)
        (c,) = g.generate(p, **GREEDY)  # no max_tokens: it runs to the pool's end, as above
        assert c.finish_reason == "length" and len(p) + len(c.token_ids) == 65


def test_max_logprobs_bounds_a_request(folder, make_gen):
    """logprobs beyond the Generator's max_logprobs (20 by default) is refused; a Generator built with a larger one
    serves it, one entry per top token."""
    g = make_gen(folder, max_batch_size=2, max_logprobs=40)
    (c,) = g.generate([5, 6, 7], max_tokens=2, logprobs=30, **GREEDY)
    assert [len(d) for d in c.logprobs] == [30, 30]
    with pytest.raises(ValueError, match="<= 40"):
        g.generate([5, 6, 7], max_tokens=2, logprobs=41, **GREEDY)
    with pytest.raises(TypeError, match="max_logprobs"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_logprobs=2.5))


def test_stream_checks_its_input_when_called(gen, good):
    """stream() and astream() submit at once: bad input raises at the call, not at the first next()."""
    with pytest.raises(TypeError):
        gen.stream(123)
    with pytest.raises(TypeError, match="max_token"):
        gen.astream([1, 2, 3], max_token=2)
    with pytest.raises(ValueError, match="max_tokens"):
        gen.stream([1, 2, 3], max_tokens=0)
    assert_still_serves(gen, good)


def test_auto_dtype_follows_the_stored_tensors(folder, tmp_path, good):
    """dtype="auto" keeps the weights as stored even where config.json names another dtype (or none)."""
    f = _copy(folder, tmp_path)
    M.edit_json(f / "config.json", lambda c: c.update(dtype="bfloat16"))
    with qwen_rt.Generator(str(f), **(M.base_kwargs(f, max_batch_size=2) | {"dtype": "auto"})) as g:
        assert g.weight_dtype == "float32"  # the tensors are F32
        p, ref = good
        assert g.generate(p, max_tokens=6, **GREEDY)[0].token_ids == ref


def test_vocab_json_without_tokenizer_json_is_named(folder, tmp_path):
    """A folder with vocab.json but no tokenizer.json: the error says which file is missing and why."""
    f = _copy(folder, tmp_path)
    (f / "tokenizer.json").unlink()
    (f / "vocab.json").write_text("{}")
    with qwen_rt.Generator(str(f), **M.base_kwargs(f, max_batch_size=2)) as g:
        assert g.tokenizer is None
        with pytest.raises(ValueError, match="no tokenizer.json.*vocab.json"):
            g.generate("hello", max_tokens=2)
        with pytest.raises(ValueError, match="no tokenizer.json"):
            g.generate([[1, 2]], max_tokens=2, stop=["x"])


def test_a_closed_generator_raises_generator_closed(folder, fresh_gen, good):
    """Every call on a closed Generator raises the public qwen_rt.GeneratorClosed (a RuntimeError)."""
    gen = fresh_gen(folder)
    gen.close()
    assert issubclass(qwen_rt.GeneratorClosed, RuntimeError)
    for call in (lambda: gen.generate(good[0], max_tokens=2), lambda: gen.submit(good[0]), gen.stats):
        with pytest.raises(qwen_rt.GeneratorClosed, match="closed"):
            call()
