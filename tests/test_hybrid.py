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


# --- prefix caching: K/V pages plus a snapshot of the DeltaNet state where the hit ends ------------------------

def test_shared_prefix_resumes_from_a_state_snapshot(build, fresh_gen, idle):
    """Requests sharing a 40-token system prompt, one after another: the second finds the first's K/V pages but no
    state there, computes them and snapshots its state where the match ended (32 tokens, two pages); the later ones
    take those pages and that state and compute only the rest. Tokens equal transformers'."""
    folder = build("qwen35_hybrid")
    gen = fresh_gen(folder)
    prompts = M.pick_prompts(folder, seed=51, lengths=[9, 3, 17, 1], max_new=8, prefix_len=40)
    outs = [gen.generate([p], max_tokens=8, **GREEDY)[0] for p in prompts]
    check_greedy(folder, prompts, outs, 8)
    assert [c.cached_tokens for c in outs] == [0, 0, 32, 32]


def test_next_turn_of_a_conversation_hits(build, fresh_gen):
    """A conversation's next turn (its prompt: the last prompt, the reply, a new message) resumes from the snapshot
    at the end of the last prompt's last full page."""
    folder = build("qwen35_mixed_tied")
    gen = fresh_gen(folder)
    (p1,) = M.pick_prompts(folder, seed=52, lengths=[37], max_new=6)
    (c1,) = gen.generate([p1], max_tokens=6, **GREEDY)
    p2 = p1 + c1.token_ids + [7, 8, 9, 10, 11]
    (c2,) = gen.generate([p2], max_tokens=6, **GREEDY)
    assert c2.cached_tokens == 32
    check_greedy(folder, [p1, p2], [c1, c2], 6)


@pytest.mark.parametrize("snapshots", [0, 1])
def test_few_snapshots_stay_exact(build, fresh_gen, idle, snapshots):
    """One snapshot (or none) for requests of three different prefixes, interleaved, with chunked prefill and
    preemption-free pools: hits only where the snapshot still holds that prefix's state; every token exact."""
    folder = build("qwen35_hybrid")
    gen = fresh_gen(folder, state_snapshots=snapshots, max_num_batched_tokens=24, max_batch_size=3)
    groups = [M.pick_prompts(folder, seed=60 + g, lengths=[5, 11], max_new=6, prefix_len=33) for g in range(3)]
    prompts = [groups[g][i] for i in range(2) for g in range(3)]
    outs = []
    for p in prompts:  # one at a time: each may hit what the one before left
        outs += gen.generate([p], max_tokens=6, **GREEDY)
    check_greedy(folder, prompts, outs, 6)
    cached = [c.cached_tokens for c in outs]
    if snapshots == 0:
        assert cached == [0] * 6
    s = idle(gen)
    assert s["free_slots"] == s["total_slots"], s


def test_concurrent_shared_prefixes_with_snapshots(build, fresh_gen, idle):
    """Many requests of two shared prefixes at once through 4 slots, chunks of 16 tokens: snapshots taken and
    restored while other requests run; every request gets its own tokens as when run alone without the cache."""
    folder = build("qwen35_hybrid")
    gen = fresh_gen(folder, max_batch_size=4, max_num_batched_tokens=16, state_snapshots=2)
    alone = fresh_gen(folder, enable_prefix_caching=False)
    prompts = [p for g in range(2) for p in M.pick_prompts(folder, seed=70 + g, lengths=[2, 6, 10, 14, 20],
                                                            max_new=5, prefix_len=48)]
    outs = [r.result() for r in [gen.submit(p, max_tokens=5, **GREEDY) for p in prompts]]
    ref = alone.generate(prompts, max_tokens=5, **GREEDY)
    assert [c.token_ids for c in outs] == [c.token_ids for c in ref]
    assert idle(gen)["cached_tokens"] > 0


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


def test_config_without_an_mtp_head(build, tmp_path):
    """mtp_num_hidden_layers 0 (a checkpoint without the head) loads as an absent key does; a negative count is a
    ValueError naming the key."""
    src = build("qwen35_hybrid")
    prompts = M.pick_prompts(src, seed=4, lengths=[9], max_new=6)
    for n, ok in ((0, True), (-1, False)):
        folder = M.copy_folder(src, tmp_path / f"mtp{n}")
        M.edit_json(folder / "config.json", lambda c: c.update(mtp_num_hidden_layers=n))
        if ok:
            gen = qwen_rt.Generator(str(folder), **M.base_kwargs(folder))
            check_greedy(src, prompts, gen.generate(prompts, max_tokens=6, **GREEDY), 6)
            gen.close()
        else:
            with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
                qwen_rt.Generator(str(folder), **M.base_kwargs(folder))


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
