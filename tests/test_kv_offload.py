"""The KV cache's host tier (Generator(kv_offload_memory=...)), on the CPU in fp32: a device pool far smaller than the
requests' contexts, pages moving out to the host tier and back, attention reading them in place. Every output equals
the run without a host tier, token for token and logprob for logprob (the moves are exact copies), also with
sparse attention, prefix hits on pages that went to the host, preemption and cancellation."""
from __future__ import annotations

import threading

import pytest

import models as M

GREEDY = dict(temperature=0.0, ignore_eos=True)
PS = 4


def offload_kwargs(folder, device_pages, host_pages, **kw):
    kw = dict(page_size=PS, max_num_batched_tokens=16, max_batch_size=2, max_model_len=400, **kw)
    kw["kv_cache_memory"] = M.kv_bytes(folder, device_pages, PS)
    kw["kv_offload_memory"] = M.kv_bytes(folder, host_pages, PS)
    return kw


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_contexts_8x_the_device_pool_equal_the_run_without_a_host_tier(build, fresh_gen, name):
    """Device pool 10 pages (40 tokens), contexts up to ~330 tokens: the same tokens and logprobs as a pool that
    holds everything; the device pool's bytes stay what they were, and pages went out and came back."""
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=11, lengths=[310, 150, 7], max_new=12)
    ref = fresh_gen(folder, page_size=PS, max_num_batched_tokens=16, max_batch_size=2, max_model_len=400)
    gen = fresh_gen(folder, **offload_kwargs(folder, device_pages=10, host_pages=200))
    want = ref.generate(prompts, max_tokens=12, logprobs=2, **GREEDY)
    got = gen.generate(prompts, max_tokens=12, logprobs=2, **GREEDY)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert g.logprobs == w.logprobs
    st = gen.stats()
    assert st["device_pages"] == 10 and st["kv_bytes"] == M.kv_bytes(folder, 10, PS)
    assert st["kv_host_bytes"] == M.kv_bytes(folder, 200, PS)
    assert st["total_pages"] == 10 + 200 - (16 // PS + 2 * 2)  # a step's pages are held back
    assert st["pages_on_device"] <= 10
    assert st["kv_bytes_to_host"] >= 70 * M.kv_bytes(folder, 1, PS)  # the 310-token prompt's pages went out
    assert st["pages_on_host"] > 0  # the prompts' cached pages
    # Decode steps of the 310-token prompt found most of its ~80 pages on the host (the device holds 10).
    assert st["page_reads_host"] > 11 * 60 and st["page_reads_device"] > 0
    assert ref.stats()["page_reads_host"] == ref.stats()["page_reads_device"] == 0  # counted with a host tier only


def test_prefix_hit_on_pages_in_the_host_tier(build, fresh_gen):
    """A prompt's pages, cached, are pushed to the host by a later request; the prompt again takes them from there
    (read in place) and gives the same output."""
    folder = build("qwen3_gqa2_tied")
    a, b = M.pick_prompts(folder, seed=12, lengths=[120, 200], max_new=8)
    gen = fresh_gen(folder, **offload_kwargs(folder, device_pages=12, host_pages=200))
    first = gen.generate([a], max_tokens=8, logprobs=1, **GREEDY)[0]
    gen.generate([b], max_tokens=8, **GREEDY)
    before = gen.stats()
    again = gen.generate([a], max_tokens=8, logprobs=1, **GREEDY)[0]
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs
    assert again.cached_tokens >= 100
    assert before["pages_on_host"] >= 25


def test_sparse_attention_over_both_tiers(build, fresh_gen):
    """Sparse decode selecting among pages of both tiers: the run without a host tier's output."""
    import qwen_rt

    folder = build("qwen3_gqa2_tied")
    prompts = M.pick_prompts(folder, seed=13, lengths=[250, 90], max_new=10)
    sa = qwen_rt.SparseAttention(budget_tokens=48, sink_tokens=4, window_tokens=8)
    ref = fresh_gen(folder, page_size=PS, max_num_batched_tokens=16, max_batch_size=2, max_model_len=400,
                    sparse_attention=sa)
    kw = offload_kwargs(folder, device_pages=12, host_pages=150)
    # A page's summary (a min and a max key row per layer, on the device for both tiers) takes a token's K/V bytes.
    kw["kv_cache_memory"] = M.kv_bytes(folder, 1, 1) * (12 * (PS + 1) + 150)
    gen = fresh_gen(folder, sparse_attention=sa, **kw)
    want = ref.generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    got = gen.generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]
    st = gen.stats()
    assert st["device_pages"] == 12 and st["sparse_rows"] > 0 and st["kv_bytes_to_host"] > 0


def test_preemption_and_cancellation_with_pages_on_the_host(build, fresh_gen, idle):
    """Short prompts growing long outputs through a pool of 20 pages (14 on the device): requests are preempted and
    recompute, one is cancelled mid-way; the others give the output they give alone, and every page is free at the
    end."""
    import numpy as np

    folder = build("qwen3_gqa2_tied")
    info = M.model_info(folder)
    rng = np.random.default_rng(14)
    prompts = [M.random_prompt(rng, int(rng.integers(8, 13)), info["vocab_size"], info["specials"]) for _ in range(5)]
    ref = fresh_gen(folder, page_size=PS, max_num_batched_tokens=16, max_batch_size=2, max_model_len=400)
    want = [ref.generate([p], max_tokens=40, **GREEDY)[0].token_ids for p in prompts]
    kw = offload_kwargs(folder, device_pages=14, host_pages=18)
    kw["max_batch_size"] = 4  # a step's pages: 16 / 4 + 2 x 4 = 12
    gen = fresh_gen(folder, **kw)
    assert gen.stats()["total_pages"] == 20
    reqs = [gen.submit(p, max_tokens=40, **GREEDY) for p in prompts]
    threading.Timer(0.05, reqs[2].cancel).start()
    for i, r in enumerate(reqs):
        c = r.result()
        if i == 2:
            assert c.finish_reason in ("cancelled", "length")
            continue
        assert c.token_ids == want[i]
    st = idle(gen)
    assert st["preemptions"] > 0
    assert st["free_pages"] == st["total_pages"]


def test_offload_arguments(build):
    import qwen_rt

    folder = build("qwen3_gqa2_tied")
    with pytest.raises(TypeError, match="kv_offload_memory"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, kv_offload_memory=1.5))
    with pytest.raises(ValueError, match="host memory available"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, kv_offload_memory=2**62))
    with pytest.raises(ValueError, match="one step writes"):  # 4 device pages cannot hold a step's 8
        qwen_rt.Generator(str(folder), **offload_kwargs(folder, device_pages=4, host_pages=20))
    with pytest.raises(ValueError, match="synthetic_prefill with kv_offload_memory"):
        qwen_rt.Generator(str(folder), synthetic_prefill=True, **offload_kwargs(folder, device_pages=12, host_pages=20))


@pytest.mark.cuda
@pytest.mark.parametrize("name,dtype", [("qwen3_hd64_gqa4", "float32"), ("qwen35_hd256", "float32"),
                                        ("qwen3_hd128_gqa2", "bfloat16")])
@pytest.mark.parametrize("move_stream", ["0", "1"])
def test_cuda_host_tier_equals_the_device_pool(build, fresh_gen, name, dtype, move_stream, monkeypatch):
    """On the GPU: pages in pinned host memory, read in place by the attention kernels (decode and prefill), give
    the output of a device pool that holds everything; with sparse attention too; the page moves on the step's stream
    or (QWEN_RT_MOVE_STREAM=1, not yet the default) on their own beside the step before."""
    import qwen_rt
    from qwen_rt import _core

    monkeypatch.setenv("QWEN_RT_MOVE_STREAM", move_stream)

    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device (or the CUDA plugin is missing)")
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=15, lengths=[300, 120], max_new=10)
    base = dict(device="cuda", dtype=dtype, page_size=16, max_num_batched_tokens=64, max_batch_size=2,
                max_model_len=400)
    for sparse in (None, qwen_rt.SparseAttention(budget_tokens=96, sink_tokens=16, window_tokens=32)):
        ref = fresh_gen(folder, sparse_attention=sparse, **base)
        eb = 4 if dtype == "float32" else 2  # the KV cache holds the activations' dtype
        # A page's summary rows (sparse) take a token's K/V bytes, on the device for the host's pages too.
        # 8 frames: 8 pages of 16 rows, or 8 + ceil(60 / 17) pages of 17 (the host pages' summaries take the rest).
        dev_bytes = M.kv_bytes(folder, 1, 1, eb) * ((8 + 4) * 17 if sparse else 8 * 16)
        gen = fresh_gen(folder, sparse_attention=sparse, kv_cache_memory=dev_bytes,
                        kv_offload_memory=M.kv_bytes(folder, 60, 16, eb), **base)
        # One request at a time: the GPU's GEMMs change with the batch, and the pools' sizes admit differently.
        want = [ref.generate([p], max_tokens=10, logprobs=1, **GREEDY)[0] for p in prompts]
        got = [gen.generate([p], max_tokens=10, logprobs=1, **GREEDY)[0] for p in prompts]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            for a, b in zip(g.logprobs, w.logprobs):
                assert max(abs(a[k] - b[k]) for k in a) < (1e-5 if dtype == "float32" else 2e-2)
        st = gen.stats()
        assert st["device_pages"] == 8 and st["kv_bytes_to_host"] > 0
