"""End-to-end generation against transformers on tiny random checkpoints (CPU, fp32)."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import models as M
import qwen_rt

ALL_CONFIGS = list(M.CONFIGS) + ["qwen3_yarn+legacy"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def ids_of(folder, text):
    return M.hf_tokenizer(str(folder)).encode(text, add_special_tokens=False)


def expected_text(folder, token_ids):
    return M.hf_tokenizer(str(folder)).decode(list(token_ids), skip_special_tokens=True)


# --- exact greedy tokens -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_greedy_matches_transformers(build, make_gen, name):
    folder = build(name)
    gen = make_gen(folder)
    n = 16
    prompts = M.pick_prompts(folder, seed=11, lengths=[1, 7, 55, 130], max_new=n)
    for p in prompts:
        (c,) = gen.generate([p], max_tokens=n, **GREEDY)
        assert c.prompt_token_ids == p
        assert c.finish_reason == "length"
        assert len(c.token_ids) == n
        msg = M.greedy_mismatch(folder, p, c.token_ids, n)
        assert not msg, msg


def test_request_fills_max_model_len_exactly(build, make_gen):
    """A prompt and max_tokens that reach max_model_len exactly (the RoPE table holds max_model_len positions):
    transformers' greedy tokens to the last one."""
    folder = build("qwen3_yarn")
    gen = make_gen(folder, max_model_len=40)
    (p,) = M.pick_prompts(folder, seed=15, lengths=[30], max_new=10)
    (c,) = gen.generate([p], max_tokens=10, **GREEDY)
    assert c.finish_reason == "length" and len(p) + len(c.token_ids) == 40
    msg = M.greedy_mismatch(folder, p, c.token_ids, 10)
    assert not msg, msg


def test_checkpoints_transformers_reads_its_own_way(build, tmp_path):
    """Two checkpoint shapes transformers 5 reads in a particular way, and so do we: a rope_scaling block added
    beside a saved rope_parameters replaces it (yarn on, with the top-level rope_theta), and tied embeddings with
    a stored lm_head unlike the embedding use that lm_head. Greedy tokens equal transformers'."""
    import torch

    yarn = M.copy_folder(build("qwen3_gqa2_tied"), tmp_path / "yarn")
    M.edit_json(yarn / "config.json", lambda c: c.update(
        rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    head = M.copy_folder(build("qwen2_bias_gqa2_tied"), tmp_path / "head")
    state = M.load_state(head)
    emb = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = torch.randn(emb.shape, generator=torch.Generator().manual_seed(5)) * emb.std()
    M.save_state(head, state)
    for folder in (yarn, head):
        prompts = M.pick_prompts(folder, seed=14, lengths=[5, 90], max_new=8)
        with qwen_rt.Generator(str(folder), **M.base_kwargs(folder)) as gen:
            for p in prompts:
                (c,) = gen.generate([p], max_tokens=8, **GREEDY)
                msg = M.greedy_mismatch(folder, p, c.token_ids, 8)
                assert not msg, (folder.name, msg)


def test_rope_scaling_argument_equals_the_edited_config(build, tmp_path):
    """Generator(rope_scaling=...) puts its keys over the config's RoPE settings as a user editing config.json would
    (Qwen3.5's partial_rotary_factor and rope_theta kept): transformers' greedy tokens on the edited checkpoint, the
    longer context served; a bad block is refused like a bad config.json."""
    folder = build("qwen35_hybrid")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    edited = M.copy_folder(folder, tmp_path / "edited")

    def edit(c):
        c["rope_parameters"] = dict(c.get("rope_parameters") or {}, **yarn)

    M.edit_json(edited / "config.json", edit)
    prompts = M.pick_prompts(edited, seed=16, lengths=[5, 90], max_new=8)
    with qwen_rt.Generator(str(folder), rope_scaling=yarn, **M.base_kwargs(folder)) as gen:
        assert gen.config["rope_scaling"]["factor"] == 4.0
        saved = json.loads((folder / "config.json").read_text())["rope_parameters"]
        assert gen.config["rope_scaling"]["partial_rotary_factor"] == saved["partial_rotary_factor"]
        for p in prompts:
            (c,) = gen.generate([p], max_tokens=8, **GREEDY)
            msg = M.greedy_mismatch(edited, p, c.token_ids, 8)
            assert not msg, msg
    with pytest.raises(TypeError, match="rope_scaling"):
        qwen_rt.Generator(str(folder), rope_scaling="yarn", **M.base_kwargs(folder))
    with pytest.raises(ValueError, match="factor"):
        qwen_rt.Generator(str(folder), rope_scaling=dict(yarn, factor=-1), **M.base_kwargs(folder))


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen3_yarn", "qwen2_bias_gqa2_tied"])
def test_chunked_prefill(build, make_gen, name):
    """Prompts longer than max_num_batched_tokens are prefilled in chunks (16-token budget)."""
    folder = build(name)
    gen = make_gen(folder, max_num_batched_tokens=16)
    n = 12
    prompts = M.pick_prompts(folder, seed=12, lengths=[40, 37, 16, 17], max_new=n)
    for p in prompts:  # one at a time
        (c,) = gen.generate([p], max_tokens=n, **GREEDY)
        msg = M.greedy_mismatch(folder, p, c.token_ids, n)
        assert not msg, msg
    outs = gen.generate(prompts, max_tokens=n, **GREEDY)  # chunks of several prompts per step
    for p, c in zip(prompts, outs):
        msg = M.greedy_mismatch(folder, p, c.token_ids, n)
        assert not msg, msg


@pytest.mark.parametrize("name", M.CONFIGS)
def test_first_token_logprobs(build, make_gen, name):
    folder = build(name)
    gen = make_gen(folder)
    N = 5
    for p in M.pick_prompts(folder, seed=13, lengths=[3, 30], max_new=2):
        (c,) = gen.generate([p], max_tokens=2, logprobs=N, **GREEDY)
        assert c.logprobs is not None and len(c.logprobs) == 2
        ref = M.hf_greedy_logprobs(folder, p, 1)[0]
        d = c.logprobs[0]
        assert c.token_ids[0] in d
        assert len(d) == N  # greedy: the chosen token is the best one, so no extra entry
        ref_top = [int(t) for t in np.argsort(-ref, kind="stable")[:N]]
        srt = np.sort(ref)[::-1]
        if srt[N - 1] - srt[N] > 1e-4:  # the top-N set is well defined
            assert set(int(k) for k in d) == set(ref_top)
        for tok, lp in d.items():
            assert abs(lp - ref[int(tok)]) < 1e-4, (tok, lp, ref[int(tok)])


# --- text, prompt forms, streaming, chat -----------------------------------------------------------

TEXT_CANDIDATES = ["Once upon a time", "Hello, how are you", "The clock tower", "Hello",
                   "The weather is", "Tell me a joke", "In the middle of", "What is two plus"]


def text_prompts(folder, n, k=3):
    """The first k candidate strings whose greedy continuation (n tokens) has no near-tie and no
    special token (deterministic per fixture)."""
    specials = set(M.model_info(folder)["specials"])
    out = []
    for t in TEXT_CANDIDATES:
        p = ids_of(folder, t)
        if (min(M.hf_greedy_margins(folder, p, n)) >= M.MARGIN
                and not set(M.hf_greedy(folder, p, n)) & specials):
            out.append(t)
    assert len(out) >= k, f"fixture: only {len(out)} well-conditioned text prompts"
    return out[:k]


@pytest.mark.parametrize("name", ["qwen3_mha_untied", "qwen2_gqa4_untied"])
def test_text_and_prompt_forms(build, make_gen, name):
    folder = build(name)
    gen = make_gen(folder)
    n = 10
    TEXT_PROMPTS = text_prompts(folder, n)
    ids = [ids_of(folder, t) for t in TEXT_PROMPTS]
    refs = [M.hf_greedy(folder, p, n) for p in ids]

    def check(c, i):
        assert c.prompt_token_ids == ids[i]
        assert c.token_ids == refs[i]
        assert c.text == expected_text(folder, c.token_ids)
        assert c.finish_reason == "length"

    out = gen.generate(TEXT_PROMPTS[0], max_tokens=n, **GREEDY)  # str
    assert isinstance(out, list) and len(out) == 1
    check(out[0], 0)
    out = gen.generate(TEXT_PROMPTS, max_tokens=n, **GREEDY)  # list[str]
    assert len(out) == 3
    for i, c in enumerate(out):
        check(c, i)
    out = gen.generate(ids[1], max_tokens=n, **GREEDY)  # list[int]
    assert len(out) == 1
    check(out[0], 1)
    out = gen.generate(ids, max_tokens=n, **GREEDY)  # list[list[int]]
    assert len(out) == 3
    for i, c in enumerate(out):
        check(c, i)
    # A SamplingParams object gives the same as keywords.
    sp = qwen_rt.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out = gen.generate(TEXT_PROMPTS, sampling=sp)
    for i, c in enumerate(out):
        check(c, i)


def test_text_skips_special_tokens(build, make_gen):
    """Completion.text is the decode of token_ids with special tokens skipped (vLLM's default);
    token_ids keep them. Uses a prompt whose greedy continuation contains a special token."""
    folder = build("qwen3_gqa4")
    gen = make_gen(folder)
    info = M.model_info(folder)
    n = 20
    rng = np.random.default_rng(5)
    for _ in range(200):
        p = M.random_prompt(rng, int(rng.integers(1, 40)), info["vocab_size"], info["specials"])
        g = M.hf_greedy(folder, p, n)
        if set(g) & set(info["specials"]) and min(M.hf_greedy_margins(folder, p, n)) >= M.MARGIN:
            break
    else:
        raise AssertionError("fixture: no greedy continuation with a special token")
    (c,) = gen.generate([p], max_tokens=n, **GREEDY)
    assert c.token_ids == g
    assert c.text == expected_text(folder, g)
    assert not any(s in c.text for s in M.SPECIAL_TOKENS)


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen2_bias_gqa2_tied"])
def test_stream_matches_generate(build, make_gen, name):
    folder = build(name)
    gen = make_gen(folder)
    n = 24
    prompts = text_prompts(folder, n) + M.pick_prompts(folder, seed=14, lengths=[9], max_new=n)
    for p in prompts:
        ids = p if isinstance(p, list) else ids_of(folder, p)
        (full,) = gen.generate([p] if isinstance(p, list) else p, max_tokens=n, **GREEDY)
        deltas = list(gen.stream(p, max_tokens=n, **GREEDY))
        assert deltas, "stream yielded nothing"
        assert "".join(d.text for d in deltas) == full.text
        assert [t for d in deltas for t in d.token_ids] == full.token_ids
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert full.token_ids == M.hf_greedy(folder, ids, n)


def _chat_ids(folder, messages):
    r = M.hf_tokenizer(str(folder)).apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True)
    if not isinstance(r, list):  # transformers 5 returns a BatchEncoding
        r = r["input_ids"]
    return list(r)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Tell me a joke about a cat."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "And three plus three?"}],
])
def test_chat_applies_template(build, make_gen, messages):
    folder = build("qwen3_gqa2_tied")
    gen = make_gen(folder)
    ref_ids = _chat_ids(folder, messages)
    n = 8
    assert min(M.hf_greedy_margins(folder, ref_ids, n)) >= M.MARGIN  # fixture: no near-tie
    c = gen.chat(messages, max_tokens=n, **GREEDY)
    assert isinstance(c, qwen_rt.Completion)
    assert c.prompt_token_ids == ref_ids
    assert c.token_ids[:n] == M.hf_greedy(folder, ref_ids, n)


# --- finish reasons ---------------------------------------------------------------------------------

def _stop_case(folder, n=12, seed=15):
    """A prompt whose greedy tokens 0..2 are distinct, so greedy[2] first occurs at step 2."""
    rng = np.random.default_rng(seed)
    info = M.model_info(folder)
    for _ in range(100):
        (p,) = M.pick_prompts(folder, seed=int(rng.integers(1 << 30)), lengths=[6], max_new=n)
        g = M.hf_greedy(folder, p, n)
        if len(set(g[:3])) == 3 and not set(g) & set(info["specials"]):
            return p, g
    raise AssertionError("fixture: no stop case")


def test_finish_reason_stop_token_ids(build, make_gen):
    folder = build("qwen3_mha_untied")
    gen = make_gen(folder)
    p, g = _stop_case(folder)
    (c,) = gen.generate([p], max_tokens=12, temperature=0.0, stop_token_ids=[g[2]])
    assert c.finish_reason == "stop"
    assert len(c.token_ids) <= 3 and len(c.token_ids) >= 2
    assert c.token_ids == g[:len(c.token_ids)]
    assert c.text == expected_text(folder, g[:2])  # the stop token is never in the text
    (c,) = gen.generate([p], max_tokens=12, temperature=0.0)
    assert c.finish_reason == "length" and c.token_ids == g


def test_finish_reason_eos_from_generation_config(build, fresh_gen, tmp_path):
    """eos ids come from generation_config.json; ignore_eos=True generates past them."""
    src = build("qwen3_mha_untied")
    p, g = _stop_case(src, seed=16)
    folder = M.copy_folder(src, tmp_path / "m")
    M.edit_json(folder / "generation_config.json", lambda c: c.update(eos_token_id=[g[2]]))
    gen = fresh_gen(folder, max_batch_size=4)
    (c,) = gen.generate([p], max_tokens=12, temperature=0.0)
    assert c.finish_reason == "stop"
    assert 2 <= len(c.token_ids) <= 3 and c.token_ids == g[:len(c.token_ids)]
    (c,) = gen.generate([p], max_tokens=12, temperature=0.0, ignore_eos=True)
    assert c.finish_reason == "length" and c.token_ids == g


# --- async ------------------------------------------------------------------------------------------

def test_agenerate_and_astream(build, make_gen):
    folder = build("qwen3_gqa4")
    gen = make_gen(folder)
    n = 10
    prompts = M.pick_prompts(folder, seed=17, lengths=[4, 20, 33], max_new=n, no_specials_out=True)

    async def main():
        outs = await gen.agenerate(prompts, max_tokens=n, **GREEDY)
        parts = []
        async for d in gen.astream(prompts[1], max_tokens=n, **GREEDY):
            parts.append(d)
        # Two concurrent async calls.
        a, b = await asyncio.gather(gen.agenerate([prompts[0]], max_tokens=n, **GREEDY),
                                    gen.agenerate([prompts[2]], max_tokens=n, **GREEDY))
        return outs, parts, a, b

    outs, parts, a, b = asyncio.run(main())
    assert len(outs) == 3
    for p, c in zip(prompts, outs):
        assert c.token_ids == M.hf_greedy(folder, p, n)
    assert [t for d in parts for t in d.token_ids] == outs[1].token_ids
    assert "".join(d.text for d in parts) == outs[1].text
    assert parts[-1].finish_reason == "length"
    assert a[0].token_ids == outs[0].token_ids and b[0].token_ids == outs[2].token_ids


# --- lifetime ---------------------------------------------------------------------------------------

def test_context_manager_and_close(build):
    folder = build("qwen3_gqa2_tied")
    (p,) = M.pick_prompts(folder, seed=18, lengths=[5], max_new=6)
    with qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2)) as gen:
        assert isinstance(gen.config, dict) and gen.config["model_type"] == "qwen3"
        assert gen.tokenizer is not None
        (c,) = gen.generate([p], max_tokens=6, **GREEDY)
        assert c.token_ids == M.hf_greedy(folder, p, 6)
    with pytest.raises((RuntimeError, ValueError)):
        gen.generate([p], max_tokens=6, **GREEDY)
    gen.close()  # a second close is fine

    gen = qwen_rt.Generator(str(folder), **M.base_kwargs(folder, max_batch_size=2))
    (c,) = gen.generate([p], max_tokens=6, **GREEDY)
    assert c.token_ids == M.hf_greedy(folder, p, 6)
    gen.close()
    gen.close()
    with pytest.raises((RuntimeError, ValueError)):
        list(gen.stream(p, max_tokens=6, **GREEDY))
    with pytest.raises((RuntimeError, ValueError)):
        gen.submit(p, max_tokens=6, **GREEDY)


def test_default_arguments(build):
    """Only device and dtype given: default pool, batch size and max_model_len work on CPU."""
    folder = build("qwen3_gqa2_tied")
    (p,) = M.pick_prompts(folder, seed=19, lengths=[12], max_new=5)
    with qwen_rt.Generator(str(folder), device="cpu", dtype="float32") as gen:
        (c,) = gen.generate([p], max_tokens=5, **GREEDY)
        assert c.token_ids == M.hf_greedy(folder, p, 5)
        s = gen.stats()
        assert s["total_slots"] == 32 and s["total_pages"] > 0


def test_dummy_weights(build):
    """load_format="dummy": random weights from config.json; the same seed gives the same weights."""
    folder = build("qwen3_gqa2_tied")
    info = M.model_info(folder)
    n = 12
    prompts = M.pick_prompts(folder, seed=20, lengths=[1, 9, 30], max_new=n)
    results = []
    for _ in range(2):
        kw = M.base_kwargs(folder, max_batch_size=4, load_format="dummy", seed=7)
        with qwen_rt.Generator(str(folder), **kw) as gen:
            outs = gen.generate(prompts, max_tokens=n, **GREEDY)
            assert all(len(c.token_ids) == n and c.finish_reason == "length" for c in outs)
            assert all(0 <= t < info["vocab_size"] for c in outs for t in c.token_ids)
            results.append([c.token_ids for c in outs])
    assert results[0] == results[1]
    # Not the checkpoint's weights, and not a constant output.
    assert results[0] != [M.hf_greedy(folder, p, n) for p in prompts]
    assert len({t for toks in results[0] for t in toks}) > 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen2_bias_gqa2_tied"])
def test_16bit_weights_close_to_fp32(build, fresh_gen, name, dtype):
    """dtype="bfloat16" / "float16" on the CPU (16-bit weights and KV cache, fp32 accumulation): logprobs of
    the first token after a 24-token prompt stay close to transformers' fp32 ones."""
    folder = build(name)
    p = M.pick_prompts(folder, seed=17, lengths=[24], max_new=1)[0]
    c = fresh_gen(folder, dtype=dtype).generate([p], max_tokens=1, logprobs=5, temperature=0.0,
                                                ignore_eos=True)[0]
    ref = M.log_softmax(M.hf_logits(str(folder), p))
    assert len(c.logprobs[0]) >= 5
    for tok, lp in c.logprobs[0].items():
        assert abs(lp - ref[tok]) < 0.1, (tok, lp, ref[tok])


def test_cpu_kv_cache_in_bf16_for_bf16_weights(build, fresh_gen):
    """bf16 weights on the CPU keep K/V in bf16: a page takes half the bytes of an fp32 one."""
    folder = build("qwen3_gqa2_tied")
    budget = 1 << 20
    page_bytes = {}
    for dtype in ("float32", "bfloat16"):
        s = fresh_gen(folder, dtype=dtype, kv_cache_memory=budget).stats()
        assert 0 < s["kv_bytes"] <= budget
        page_bytes[dtype] = s["kv_bytes"] / s["total_pages"]
    assert page_bytes["bfloat16"] * 2 == page_bytes["float32"], page_bytes


def test_cpu_kv_pool_is_committed_only_when_used(build, fresh_gen):
    """A CPU KV pool sized for long contexts costs no start-up memory: its pages are taken when written."""
    import os

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    folder = build("qwen3_gqa2_tied")
    before = rss()
    g = fresh_gen(folder, kv_cache_memory=2 << 30)
    assert g.generate([[3, 4, 5]], max_tokens=4, ignore_eos=True)[0].token_ids
    assert rss() - before < (512 << 20)
