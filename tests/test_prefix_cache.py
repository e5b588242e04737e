"""Prefix caching (CPU, fp32): requests that start with tokens an earlier request computed take its cached K/V
pages instead of computing them again, and their tokens and logprobs are those of the uncached run and of
transformers. (tests/scheduler_sim.cpp checks the page bookkeeping over thousands of random workloads.)"""
from __future__ import annotations

import numpy as np
import pytest

import models as M

GREEDY = dict(temperature=0.0, ignore_eos=True)
PAGE = 16


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_prefix_equals_uncached_and_transformers(build, fresh_gen, tp):
    """A first request fills the cache; six more with its 48-token prefix (3 pages) each take those pages and
    compute only their own tokens. Tokens equal the cache-off run and transformers'; logprobs agree."""
    folder = build("qwen3_gqa2_tied")
    prompts = M.pick_prompts(folder, seed=3, prefix_len=3 * PAGE, lengths=[5, 1, 17, 30, 9, 16, 2],
                                     max_new=8)
    on = fresh_gen(folder, tensor_parallel_size=tp, max_batch_size=8, max_num_batched_tokens=64)
    off = fresh_gen(folder, tensor_parallel_size=tp, max_batch_size=8, max_num_batched_tokens=64,
                    enable_prefix_caching=False)
    results = {}
    for name, gen in (("on", on), ("off", off)):
        first = gen.generate(prompts[:1], max_tokens=8, logprobs=2, **GREEDY)
        rest = gen.generate(prompts[1:], max_tokens=8, logprobs=2, **GREEDY)
        results[name] = first + rest
    for p, a, b in zip(prompts, results["on"], results["off"]):
        assert a.token_ids == b.token_ids
        assert not M.greedy_mismatch(folder, p, a.token_ids, 8)
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            assert max(abs(da[k] - db[k]) for k in da) < 1e-4
    assert on.stats()["cached_tokens"] == 6 * 3 * PAGE  # every later request skipped the 3 prefix pages
    assert [c.cached_tokens for c in results["on"]] == [0] + [3 * PAGE] * 6
    assert all(c.cached_tokens == 0 for c in results["off"])
    assert off.stats()["cached_tokens"] == 0 and off.stats()["cached_pages"] == 0
    assert on.stats()["cached_pages"] > 0


def test_same_prompt_again_reuses_all_but_the_last_tokens_page(build, fresh_gen):
    """The page of a prompt's last token is always computed (its logits give the first new token): a 40-token
    prompt run again takes 2 pages from the cache, a 32-token one 1."""
    folder = build("qwen3_mha_untied")
    (p40,) = M.pick_prompts(folder, seed=21, lengths=[40], max_new=6)
    p32 = p40[:32]
    gen = fresh_gen(folder, max_batch_size=4)
    want40 = gen.generate([p40], max_tokens=6, **GREEDY)[0].token_ids
    assert not M.greedy_mismatch(folder, p40, want40)
    assert gen.generate([p40], max_tokens=6, **GREEDY)[0].token_ids == want40
    assert gen.stats()["cached_tokens"] == 2 * PAGE
    before = gen.stats()["cached_tokens"]
    got32 = gen.generate([p32], max_tokens=6, **GREEDY)[0].token_ids
    assert gen.stats()["cached_tokens"] - before == PAGE
    off = fresh_gen(folder, max_batch_size=4, enable_prefix_caching=False)
    assert got32 == off.generate([p32], max_tokens=6, **GREEDY)[0].token_ids


def test_next_turn_reuses_the_conversation_so_far(build, fresh_gen):
    """A follow-up prompt that holds the first prompt and its answer takes every full page of them that was
    computed (the answer's last token never is: it was sampled, not fed)."""
    folder = build("qwen3_gqa2_tied")
    (p1,) = M.pick_prompts(folder, seed=5, lengths=[23], max_new=20)
    gen = fresh_gen(folder, max_batch_size=4)
    a1 = gen.generate([p1], max_tokens=20, **GREEDY)[0].token_ids
    info = M.model_info(folder)
    follow = M.random_prompt(np.random.default_rng(9), 7, info["vocab_size"], info["specials"])
    p2 = p1 + a1 + follow
    before = gen.stats()["cached_tokens"]
    c2 = gen.generate([p2], max_tokens=5, **GREEDY)[0]
    a2 = c2.token_ids
    computed = len(p1) + len(a1) - 1
    assert gen.stats()["cached_tokens"] - before == computed // PAGE * PAGE == c2.cached_tokens
    off = fresh_gen(folder, max_batch_size=4, enable_prefix_caching=False)
    assert a2 == off.generate([p2], max_tokens=5, **GREEDY)[0].token_ids


def test_cache_gives_way_to_new_requests_and_stays_correct(build, fresh_gen, idle):
    """A pool of 12 pages: cached pages are handed out again as new prompts need them (no preemption and no
    refusal for want of pages), and a prompt whose pages were reused or kept still gets its own tokens."""
    folder = build("qwen3_gqa4")
    lens = [40, 35, 44, 38, 41, 36]
    prompts = M.pick_prompts(folder, seed=31, lengths=lens, max_new=6)
    gen = fresh_gen(folder, max_batch_size=2, kv_cache_memory=M.kv_bytes(folder, 12))
    for p in prompts + prompts[:2]:
        (c,) = gen.generate([p], max_tokens=6, **GREEDY)
        assert not M.greedy_mismatch(folder, p, c.token_ids)
    s = idle(gen)
    assert s["free_pages"] == s["total_pages"] == 12
    assert 0 < s["cached_pages"] <= 12 and s["preemptions"] == 0


def test_concurrent_shared_prefix_requests_match_alone(build, fresh_gen):
    """32 requests with 4 prefixes, submitted at once under a small budget (so later chunks start while pages
    of the same prefix are being filled): each gets its own tokens."""
    folder = build("qwen2_bias_gqa2_tied")
    prompts = []
    for seed in range(4):
        prompts += M.pick_prompts(folder, seed=40 + seed, prefix_len=2 * PAGE + 3,
                                  lengths=[1, 4, 9, 13, 16, 20, 27, 33], max_new=6)
    gen = fresh_gen(folder, max_batch_size=6, max_num_batched_tokens=40)
    reqs = [gen.submit(p, max_tokens=6, **GREEDY) for p in prompts]
    for p, r in zip(prompts, reqs):
        assert not M.greedy_mismatch(folder, p, r.result().token_ids)
    assert gen.stats()["cached_tokens"] > 0


def test_enable_prefix_caching_must_be_a_bool(build):
    import qwen_rt
    folder = build("qwen3_gqa4")
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, enable_prefix_caching=1))
