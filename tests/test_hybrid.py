"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention) on the CPU in fp32: the per-slot state across chunked
prefill, batching, slot reuse, preemption and tensor parallelism; Qwen's multimodal checkpoint layout; bad
checkpoints. (Greedy tokens and logprobs against transformers for every hybrid fixture: test_generate.py.)"""
from __future__ import annotations

import numpy as np
import pytest

import models as M
import qwen_rt

GREEDY = dict(temperature=0.0, ignore_eos=True)


def check_greedy(folder, prompts, outs, n):
    for p, c in zip(prompts, outs):
        msg = M.greedy_mismatch(folder, p, c.token_ids, n)
        assert not msg, msg


def test_multimodal_layout_reads_the_text_model(build, make_gen):
    """Qwen's checkpoints: text_config, weights under model.language_model., vision and MTP tensors beside them.
    The same weights as the plain layout give transformers' tokens (of the plain layout)."""
    plain = build("qwen35_hybrid")
    folder = build("qwen35_hybrid+multimodal")
    gen = make_gen(folder)
    prompts = M.pick_prompts(plain, seed=3, lengths=[5, 40], max_new=12)
    outs = gen.generate(prompts, max_tokens=12, **GREEDY)
    check_greedy(plain, prompts, outs, 12)


@pytest.mark.parametrize("chunk", [1, 3, 16, 37])
def test_chunked_prefill_carries_the_state(build, fresh_gen, chunk):
    """Prompts fed in chunks of `chunk` tokens per step (the conv and recurrent state carried from step to step)
    give the one-shot tokens."""
    folder = build("qwen35_mixed_tied")
    gen = fresh_gen(folder, max_num_batched_tokens=chunk, max_batch_size=4)
    prompts = M.pick_prompts(folder, seed=21, lengths=[2, 45, 70], max_new=8)
    outs = gen.generate(prompts, max_tokens=8, **GREEDY)
    check_greedy(folder, prompts, outs, 8)


def test_many_requests_reuse_slots(build, fresh_gen, idle):
    """64 mixed requests through 6 slots: each slot's state is started afresh for every request it serves, so
    every request gets its own tokens, as when run alone."""
    folder = build("qwen35_hybrid")
    gen = fresh_gen(folder, max_batch_size=6, max_num_batched_tokens=64)
    rng = np.random.default_rng(7)
    info = M.model_info(folder)
    prompts = [M.random_prompt(rng, int(rng.integers(1, 60)), info["vocab_size"], info["specials"])
               for _ in range(64)]
    lens = [int(rng.integers(1, 12)) for _ in prompts]
    reqs = [gen.submit(p, max_tokens=n, **GREEDY) for p, n in zip(prompts, lens)]
    outs = [r.result() for r in reqs]
    for p, n, c in zip(prompts, lens, outs):
        (alone,) = gen.generate([p], max_tokens=n, **GREEDY)
        assert c.token_ids == alone.token_ids
    # The reference for a sample of them.
    check_greedy(folder, prompts[:6], outs[:6], None)
    s = idle(gen)
    assert s["state_bytes"] > 0 and s["free_slots"] == s["total_slots"], s


def test_preemption_recomputes_the_state(build, fresh_gen, idle):
    """A KV pool of 6 pages for 8 slots of long outputs: requests are preempted and recompute their state from
    the prompt; every request still gets transformers' tokens."""
    folder = build("qwen35_hybrid")
    info = M.model_info(folder)
    attention_layers = info["config"]["layer_types"].count("full_attention")
    page_bytes = 16 * attention_layers * 2 * info["kv_heads"] * info["head_dim"] * 4
    gen = fresh_gen(folder, max_batch_size=8, max_model_len=64, kv_cache_memory=6 * page_bytes)
    assert gen.stats()["total_pages"] == 6
    rng = np.random.default_rng(200)
    work = [(M.random_prompt(rng, int(rng.integers(8, 16)), info["vocab_size"], info["specials"]),
             int(rng.integers(40, 48))) for _ in range(12)]
    outs = [r.result() for r in [gen.submit(p, max_tokens=n, **GREEDY) for p, n in work]]
    for (p, n), c in zip(work, outs):
        assert c.finish_reason == "length"
        msg = M.greedy_mismatch(folder, p, c.token_ids, n)
        assert not msg, msg
    assert idle(gen)["preemptions"] > 0


@pytest.mark.parametrize("name,tp", [("qwen35_hybrid", 2), ("qwen35_hybrid", 4), ("qwen35_ratio3", 2)])
def test_tensor_parallel_equals_one_rank(build, fresh_gen, name, tp):
    """DeltaNet key and value heads (and their conv channels, z, a, b, A_log, dt_bias) split across ranks; KV
    heads replicated at TP=4 over 2 KV heads. fp32 logprobs equal one rank's closely, tokens exactly."""
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=31, lengths=[3, 50], max_new=10)
    one = fresh_gen(folder).generate(prompts, max_tokens=10, logprobs=3, **GREEDY)
    many = fresh_gen(folder, tensor_parallel_size=tp).generate(prompts, max_tokens=10, logprobs=3, **GREEDY)
    for a, b in zip(one, many):
        assert a.token_ids == b.token_ids
        for da, db in zip(a.logprobs, b.logprobs):
            for tok, lp in da.items():
                assert abs(lp - db[tok]) < 1e-4


def test_tensor_parallel_must_divide_the_deltanet_heads(build):
    folder = build("qwen35_ratio3")  # 2 key heads
    with pytest.raises(ValueError, match="DeltaNet heads"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, tensor_parallel_size=4))


def test_bad_hybrid_checkpoints_are_value_errors(build, tmp_path):
    src = build("qwen35_hybrid")
    missing = M.copy_folder(src, tmp_path / "missing")
    state = M.load_state(missing)
    del state["model.layers.1.linear_attn.A_log"]
    M.save_state(missing, state)
    with pytest.raises(ValueError, match="model.layers.1.linear_attn.A_log"):
        qwen_rt.Generator(str(missing), **M.base_kwargs(missing))

    shaped = M.copy_folder(src, tmp_path / "shaped")
    state = M.load_state(shaped)
    w = state["model.layers.0.linear_attn.conv1d.weight"]
    state["model.layers.0.linear_attn.conv1d.weight"] = w[:, :, :3].contiguous()
    M.save_state(shaped, state)
    with pytest.raises(ValueError, match="conv1d.weight"):
        qwen_rt.Generator(str(shaped), **M.base_kwargs(shaped))

    for edit, match in ((lambda c: c.update(layer_types=["full_attention", "sliding_attention"] * 2), "layer type"),
                        (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
                        (lambda c: c.update(linear_num_value_heads=6), "linear_num_value_heads")):
        bad = M.copy_folder(src, tmp_path / f"cfg{len(list(tmp_path.iterdir()))}")
        M.edit_json(bad / "config.json", edit)
        with pytest.raises(ValueError, match=match):
            qwen_rt.Generator(str(bad), **M.base_kwargs(bad))


def test_packaged_qwen38_27b_shape(tmp_path):
    """The packaged Qwen3.8-27B config resolves to its plan: 48 DeltaNet and 16 attention layers."""
    from qwen_rt.config import native_config
    from qwen_rt.model_files import resolve, text_config

    c = native_config(text_config(resolve("qwen3.8-27b", load_format="dummy").config))
    assert c.arch == "qwen3_5" and c.num_layers == 64 and c.hidden_size == 5120 and c.vocab_size == 248320
    assert c.layer_types.count("full_attention") == 16 and c.layer_types[3] == "full_attention"
    assert (c.num_q_heads, c.num_kv_heads, c.head_dim) == (24, 4, 256)
    assert (c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim) == (16, 48, 128, 128)
    assert len(c.rope_inv_freq) * 2 == 64  # partial rotary 0.25 of 256
