"""Speculative decoding with the checkpoint's MTP head (Generator(speculative_tokens=k)), on the CPU in fp32.

A step feeds each decoding request's draft after its last token and samples every row with the draws the request
would use without speculation; the draft tokens that equal the samples before them stand. Outputs therefore equal
the run without speculation token for token, greedy or sampled, whatever the head proposes: an "echo" head built to
agree with the model most of the time (most drafts stand) and a random one (most are rejected) both check it, with
chunked prefill, prefix hits, preemption and cancellation, and the DeltaNet states rolled back after rejections."""
from __future__ import annotations

import numpy as np
import pytest

import models as M

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(gen, prompts, n, **kw):
    return gen.generate(prompts, max_tokens=n, logprobs=2, **kw)


def same(a, b):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert len(x.logprobs) == len(y.logprobs)
        for u, v in zip(x.logprobs, y.logprobs):
            assert u.keys() == v.keys() and max(abs(u[t] - v[t]) for t in u) < 1e-4


@pytest.mark.parametrize("head,k", [("mtp_echo", 1), ("mtp_echo", 3), ("mtp_random", 2)])
def test_greedy_equals_no_speculation(build, fresh_gen, head, k):
    folder = build("qwen35_hybrid+" + head)
    prompts = M.pick_prompts(folder, seed=31, lengths=[5, 23, 40, 12], max_new=20)
    kw = dict(max_batch_size=4, max_num_batched_tokens=16)  # prompts in chunks
    want = run(fresh_gen(folder, **kw), prompts, 20, **GREEDY)
    # Drafting never pauses: every decode step of the random head rolls back.
    gen = fresh_gen(folder, speculative_tokens=k, speculative_min_acceptance=0, **kw)
    got = run(gen, prompts, 20, **GREEDY)
    same(got, want)
    st = gen.stats()
    assert st["spec_drafted"] > 0 and len(st["spec_accepted_at"]) == k and st["spec_pauses"] == 0
    rate = st["spec_accepted"] / st["spec_drafted"]
    if head == "mtp_echo":
        assert rate > 0.4, st  # the head mostly agrees: most steps emit several tokens
        assert st["steps"] < 20 * 4, st
    else:
        assert rate < 0.3, st
    # A prefix hit (the same prompts again) and the DeltaNet snapshots it resumes from: the same output.
    same(run(gen, prompts, 20, **GREEDY), want)


def test_drafting_pauses_where_drafts_do_not_stand(build, fresh_gen):
    """The random head's drafts rarely stand: each request soon decodes plainly for speculative_pause_steps steps
    between tries (fewer drafts fed, fewer wasted rows); the echo head's mostly stand and never pause. Outputs are
    the plain run's either way."""
    for head, pauses in (("mtp_random", True), ("mtp_echo", False)):
        folder = build("qwen35_hybrid+" + head)
        prompts = M.pick_prompts(folder, seed=33, lengths=[7, 30], max_new=40)
        want = run(fresh_gen(folder, max_batch_size=2), prompts, 40, **GREEDY)
        always = fresh_gen(folder, max_batch_size=2, speculative_tokens=2, speculative_min_acceptance=0)
        adaptive = fresh_gen(folder, max_batch_size=2, speculative_tokens=2, speculative_pause_steps=12)
        same(run(always, prompts, 40, **GREEDY), want)
        same(run(adaptive, prompts, 40, **GREEDY), want)
        a, b = always.stats(), adaptive.stats()
        if pauses:
            assert b["spec_pauses"] >= 2 and b["spec_drafted"] < a["spec_drafted"] / 2, (a, b)
        else:
            assert b["spec_pauses"] == 0 and b["spec_drafted"] == a["spec_drafted"], (a, b)


def test_sampling_equals_no_speculation(build, fresh_gen):
    """Sampled tokens with seeds: the rows draw what the plain run draws, so the output is the same."""
    folder = build("qwen35_hybrid+mtp_echo")
    prompts = M.pick_prompts(folder, seed=32, lengths=[9, 30], max_new=24)
    kw = dict(temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True)
    want = [fresh_gen(folder, max_batch_size=2).generate([p], max_tokens=24, seed=i, **kw)[0].token_ids
            for i, p in enumerate(prompts)]
    gen = fresh_gen(folder, max_batch_size=2, speculative_tokens=2)
    got = [gen.generate([p], max_tokens=24, seed=i, **kw)[0].token_ids for i, p in enumerate(prompts)]
    assert got == want
    assert gen.stats()["spec_accepted"] > 0


def test_preemption_cancellation_and_per_request_off(build, fresh_gen, idle):
    """A pool too small for every request at once (preemption, recomputation), one request cancelled, one with
    speculation off: the others' outputs are the plain run's, and everything is freed."""
    import threading

    folder = build("qwen35_hybrid+mtp_echo")
    info = M.model_info(folder)
    rng = np.random.default_rng(33)
    prompts = [M.random_prompt(rng, int(rng.integers(6, 14)), info["vocab_size"], info["specials"]) for _ in range(6)]
    plain = fresh_gen(folder, max_batch_size=4)
    want = [plain.generate([p], max_tokens=40, **GREEDY)[0].token_ids for p in prompts]
    gen = fresh_gen(folder, max_batch_size=4, speculative_tokens=2, page_size=4,
                    kv_cache_memory=M.kv_bytes(folder, 2, 1) * 4 * 24)  # 24 pages of 4 (the MTP layer's K/V too)
    reqs = [gen.submit(p, max_tokens=40, speculative=(i != 4), **GREEDY) for i, p in enumerate(prompts)]
    threading.Timer(0.05, reqs[2].cancel).start()
    for i, r in enumerate(reqs):
        c = r.result()
        if i == 2:
            assert c.finish_reason in ("cancelled", "length")
            continue
        assert c.token_ids == want[i], i
    st = idle(gen)
    assert st["preemptions"] > 0 and st["spec_accepted"] > 0
    assert st["free_pages"] == st["total_pages"] and st["free_slots"] == st["total_slots"]


def test_stop_inside_an_accepted_draft(build, fresh_gen):
    """A stop token or max_tokens reached in the middle of the tokens one step confirms: the output ends there."""
    folder = build("qwen35_hybrid+mtp_echo")
    (p,) = M.pick_prompts(folder, seed=34, lengths=[10], max_new=30)
    plain = fresh_gen(folder, max_batch_size=2)
    full = plain.generate([p], max_tokens=30, **GREEDY)[0].token_ids
    gen = fresh_gen(folder, max_batch_size=2, speculative_tokens=3)
    for n in (1, 2, 7, 13):
        assert gen.generate([p], max_tokens=n, **GREEDY)[0].token_ids == full[:n]
    stop = full[9]
    got = gen.generate([p], max_tokens=30, stop_token_ids=[stop], temperature=0.0)[0]
    assert got.token_ids == full[:full.index(stop) + 1] and got.finish_reason == "stop"


def test_speculation_needs_an_mtp_head(build):
    import qwen_rt

    folder = build("qwen35_hybrid")
    with pytest.raises(ValueError, match="multi-token-prediction head"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, speculative_tokens=2))
    with pytest.raises(ValueError, match="speculative_tokens"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, speculative_tokens=-1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_speculation_equals_no_speculation(build, fresh_gen, dtype):
    """On the GPU (the MTP head, verification rows, the DeltaNet kernels keeping states, the rollback): greedy
    tokens equal the plain run's, one request at a time (the GPU's GEMMs change with the batch)."""
    from qwen_rt import _core

    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device (or the CUDA plugin is missing)")
    import shutil

    folder = build("qwen35_hd256")
    echo = folder.parent / "echo"
    if not echo.exists():
        shutil.copytree(folder, echo)
        M.add_mtp(echo, "echo")
    prompts = M.pick_prompts(echo, seed=35, lengths=[7, 40], max_new=16)
    kw = dict(device="cuda", dtype=dtype, max_batch_size=2)
    plain = fresh_gen(echo, **kw)
    want = [plain.generate([p], max_tokens=16, **GREEDY)[0].token_ids for p in prompts]
    gen = fresh_gen(echo, speculative_tokens=2, **kw)
    got = [gen.generate([p], max_tokens=16, **GREEDY)[0].token_ids for p in prompts]
    assert got == want
    assert gen.stats()["spec_accepted"] > 0


def test_speculation_with_sparse_attention_and_a_host_tier(build, fresh_gen):
    """Speculation composed with sparse decode and a host tier smaller than the contexts: the output of the same
    configuration without speculation (the MTP layer's K/V live in the same pages and move with them; drafts stop
    where selection starts: verification rows attend to every page)."""
    import qwen_rt

    folder = build("qwen35_hybrid+mtp_echo")
    prompts = M.pick_prompts(folder, seed=36, lengths=[150, 20], max_new=20)
    sa = qwen_rt.SparseAttention(budget_tokens=48, sink_tokens=4, window_tokens=8)
    row = M.kv_bytes(folder, 1, 1) * 2  # a token's K/V in every attention layer, the MTP layer's too
    kw = dict(max_batch_size=2, page_size=4, max_num_batched_tokens=16, sparse_attention=sa,
              kv_cache_memory=row * (16 * 5 + 120), kv_offload_memory=row * 120 * 4 // 2)
    want = fresh_gen(folder, **kw).generate(prompts, max_tokens=20, **GREEDY)
    gen = fresh_gen(folder, speculative_tokens=2, **kw)
    got = gen.generate(prompts, max_tokens=20, **GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    st = gen.stats()
    assert st["spec_accepted"] > 0 and st["sparse_rows"] > 0 and st["kv_bytes_to_host"] > 0
