"""Stress: random arrivals, cancellations and preemption under a tiny KV pool, from several threads;
every request that is not cancelled gets exactly its own greedy tokens, and the engine ends idle."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import models as M

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("tp,shared", [(1, False), (2, False), (1, True)])
def test_arrivals_cancels_preemption(build, fresh_gen, idle, tp, shared):
    """shared: every prompt starts with one 16-token page (the prefix cache serves it to requests, cancelled and
    preempted ones included, while they come and go)."""
    folder = build("qwen3_gqa4")
    gen = fresh_gen(folder, tensor_parallel_size=tp, max_batch_size=6, max_model_len=64,
                    max_num_batched_tokens=20, kv_cache_memory=M.kv_bytes(folder, 7, 16))
    rng = np.random.default_rng(99)
    # Outputs longer than prompts: three concurrent requests outgrow the 7 pages whatever admission reserved.
    lens = [int(x) for x in rng.integers(3, 21, size=36)]
    mts = [int(x) for x in rng.integers(24, 45, size=36)]
    if shared:
        prompts = M.pick_prompts(folder, seed=78, prefix_len=16, lengths=[max(1, n - 16) for n in lens],
                                          max_new=44)
    else:
        prompts = M.pick_prompts(folder, seed=77, lengths=lens, max_new=44)
    results, errors = {}, []

    def client(k):
        r = random.Random(k)
        for i in range(k, 36, 3):
            try:
                req = gen.submit(prompts[i], max_tokens=mts[i], **GREEDY)
                if r.random() < 0.25:  # cancel some after a few tokens
                    for n, _ in enumerate(req):
                        if n >= 1:
                            break
                    results[i] = ("cancelled", req.completion())
                else:
                    results[i] = ("done", req.result())
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    ts = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not errors, errors[0]
    assert len(results) == 36
    for i, (kind, c) in results.items():
        if kind == "done":
            assert c.finish_reason == "length"
            assert not M.greedy_mismatch(folder, prompts[i], c.token_ids, mts[i]), i
        else:
            assert c.finish_reason in ("cancelled", "length")
            assert c.token_ids == M.hf_greedy(str(folder), prompts[i], mts[i])[:len(c.token_ids)]
    s = idle(gen)
    assert s["free_slots"] == s["total_slots"] and s["free_pages"] == s["total_pages"], s
    assert s["running"] == 0 and s["waiting"] == 0, s
    assert s["preemptions"] > 0, s  # the pool was small enough to force recomputation
    assert s["cached_tokens"] > 0 or not shared, s


def test_seeded_sampling_survives_preemption(build, fresh_gen, idle):
    """Seeded temperature sampling: tokens alone equal tokens in a crowded batch that preempts."""
    folder = build("qwen2_gqa4_untied")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(4, 16, size=12)]
    kw = dict(temperature=0.9, top_p=0.95, max_tokens=44, ignore_eos=True)  # 3-4 pages each, 6 in the pool
    alone_gen = fresh_gen(folder, max_batch_size=1)
    alone = [alone_gen.generate([p], seed=100 + i, **kw)[0].token_ids for i, p in enumerate(prompts)]
    crowded = fresh_gen(folder, max_batch_size=8, max_model_len=64, max_num_batched_tokens=24,
                        kv_cache_memory=M.kv_bytes(folder, 6, 16))
    reqs = [crowded.submit(p, seed=100 + i, **kw) for i, p in enumerate(prompts)]
    together = [r.result().token_ids for r in reqs]
    assert together == alone
    assert idle(crowded)["preemptions"] > 0
