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
    gen = fresh_gen(folder, sparse_attention=sa, kv_staging_pages=0, **kw)  # host pages read in place
    want = ref.generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    got = gen.generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]
    st = gen.stats()
    assert st["device_pages"] == 12 and st["sparse_rows"] > 0 and st["kv_bytes_to_host"] > 0
    assert st["staging_pages"] == st["staging_reads"] == 0 and st["page_reads_host"] > 0


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_staging_keeps_selected_host_pages_on_the_device(build, fresh_gen, name):
    """Sparse decode over a host tier with a staging area (ops.h KvStaging): the pages a step selects from the host
    are copied into staging frames and read there by later steps; the output is the run without a host tier's, token
    for token and logprob for logprob, with enough frames (every chosen page staged: reads repeat, copies do not),
    with too few (the rest read in place) and with none."""
    import qwen_rt

    folder = build(name)
    prompts = M.pick_prompts(folder, seed=17, lengths=[260, 180], max_new=16)
    sa = qwen_rt.SparseAttention(budget_tokens=32, sink_tokens=8, window_tokens=8)  # 4 of 8 pages chosen
    ref = fresh_gen(folder, page_size=PS, max_num_batched_tokens=16, max_batch_size=2, max_model_len=400,
                    sparse_attention=sa)
    want = ref.generate(prompts, max_tokens=16, logprobs=2, **GREEDY)
    kw = offload_kwargs(folder, device_pages=120, host_pages=200, sparse_attention=sa)
    stats = {}
    for slots in (24, 3, 0):
        gen = fresh_gen(folder, kv_staging_pages=slots, **kw)
        got = gen.generate(prompts, max_tokens=16, logprobs=2, **GREEDY)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [g.logprobs for g in got] == [w.logprobs for w in want]
        st = stats[slots] = gen.stats()
        assert st["staging_pages"] == slots and st["page_reads_host"] > 0
    full, few, none = stats[24], stats[3], stats[0]
    # Two requests, 15 selecting steps each, up to 6 host pages (sink and chosen) per list, head and layer.
    assert full["staging_in_place"] == 0 and full["staging_copies"] > 0
    assert full["staging_reads"] > 2 * full["staging_copies"]  # chosen again and again: read from the frames
    assert few["staging_in_place"] > 0 and few["staging_reads"] > 0
    assert none["staging_reads"] == none["staging_copies"] == none["staging_in_place"] == 0


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


def test_offload_arguments(build, monkeypatch):
    import qwen_rt

    folder = build("qwen3_gqa2_tied")
    with pytest.raises(TypeError, match="kv_offload_memory"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, kv_offload_memory=1.5))
    with pytest.raises(ValueError, match="host memory available"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, kv_offload_memory=2**62))
    with pytest.raises(ValueError, match="one step writes"):  # 4 device pages cannot hold a step's 8
        qwen_rt.Generator(str(folder), **offload_kwargs(folder, device_pages=4, host_pages=20))
    sa = qwen_rt.SparseAttention(budget_tokens=32, sink_tokens=8, window_tokens=8)
    with pytest.raises(ValueError, match="kv_staging_pages needs sparse attention"):
        qwen_rt.Generator(str(folder), kv_staging_pages=4, **offload_kwargs(folder, device_pages=40, host_pages=20))
    with pytest.raises(ValueError, match="kv_staging_pages needs a host tier"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, kv_staging_pages=4, sparse_attention=sa, page_size=PS))
    with pytest.raises(ValueError, match="staging frames leave the device KV pool"):
        qwen_rt.Generator(str(folder), kv_staging_pages=400, sparse_attention=sa,
                          **offload_kwargs(folder, device_pages=60, host_pages=20))
    # The default: no staging; QWEN_RT_KV_STAGING=1's (twice the budget's 8 pages) never refuses a pool: it shrinks
    # where its frames and map would take over a quarter of what the pool holds beyond a step's pages.
    plain = qwen_rt.Generator(str(folder), sparse_attention=sa,
                              **offload_kwargs(folder, device_pages=400, host_pages=200))
    assert plain.stats()["staging_pages"] == 0
    plain.close()
    monkeypatch.setenv("QWEN_RT_KV_STAGING", "1")
    for device_pages, want in ((60, 0), (80, 2), (400, 16)):
        small = qwen_rt.Generator(str(folder), sparse_attention=sa,
                                  **offload_kwargs(folder, device_pages=device_pages, host_pages=200))
        assert small.stats()["staging_pages"] == want
        small.close()
    with pytest.raises(ValueError, match="kv_staging_pages must be >= 0"):
        qwen_rt.Generator(str(folder), kv_staging_pages=-1, **offload_kwargs(folder, device_pages=40, host_pages=20))


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_synthetic_prefill_fills_the_host_tier(build, fresh_gen, name):
    """Benchmarks' stand-in contexts longer than the device pool (a 300-token prompt, ~20 device pages of 4 tokens):
    the stand-in pages beyond the device pool lie in the host tier and are read in place; sparse attention over
    them with a budget that covers every page equals full attention over a device pool of as many pages, and one
    that does not selects fewer pages; a second engine gives the same tokens and logprobs."""
    import qwen_rt

    folder = build(name)
    (p,) = M.pick_prompts(folder, seed=23, lengths=[300], max_new=6)
    # The summaries of every frame (both tiers) live in the device pool's bytes: 80 pages' worth leave ~20 frames.
    kw = offload_kwargs(folder, device_pages=80, host_pages=200, synthetic_prefill=True)
    runs, stats = {}, {}

    def run(label, budget=0, device_pages=None):
        sa = qwen_rt.SparseAttention(budget_tokens=budget, sink_tokens=8, window_tokens=8) if budget else None
        extra = {"kv_cache_memory": M.kv_bytes(folder, device_pages, PS)} if device_pages else {}
        gen = fresh_gen(folder, **{**kw, "sparse_attention": sa, **extra})
        runs[label] = gen.generate([p], max_tokens=6, logprobs=1, **GREEDY)[0]
        st = stats[label] = gen.stats()
        assert len(runs[label].token_ids) == 6 and st["steps"] == 6  # the prompt in one step
        assert st["pages_on_device"] <= st["device_pages"] < 300 // PS // 2
        assert st["page_reads_host"] >= 6 * (300 // PS - st["device_pages"])  # each step read the host's pages

    run("all", budget=320)
    run("sparse", budget=32)
    assert stats["sparse"]["sparse_pages_attended"] < stats["sparse"]["sparse_pages_held"] // 2
    run("full", device_pages=stats["all"]["device_pages"])
    run("full again", device_pages=stats["all"]["device_pages"])
    assert runs["all"].token_ids == runs["full again"].token_ids == runs["full"].token_ids
    assert runs["full again"].logprobs == runs["full"].logprobs


@pytest.mark.cuda
@pytest.mark.parametrize("name,dtype", [("qwen3_hd64_gqa4", "float32"), ("qwen35_hd256", "float32"),
                                        ("qwen3_hd128_gqa2", "bfloat16")])
@pytest.mark.parametrize("move_stream", ["0", "1"])
def test_cuda_host_tier_equals_the_device_pool(build, fresh_gen, name, dtype, move_stream, monkeypatch):
    """On the GPU: pages in pinned host memory, read in place by the attention kernels (decode and prefill), give
    the output of a device pool that holds everything; with sparse attention too, its chosen host pages read in place
    or from staging frames (the staging kernel); the page moves on the step's stream or (QWEN_RT_MOVE_STREAM=1, not
    yet the default) on their own beside the step before."""
    import qwen_rt
    from qwen_rt import _core

    monkeypatch.setenv("QWEN_RT_MOVE_STREAM", move_stream)

    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device (or the CUDA plugin is missing)")
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=15, lengths=[300, 120], max_new=10)
    base = dict(device="cuda", dtype=dtype, page_size=16, max_num_batched_tokens=64, max_batch_size=2,
                max_model_len=400)
    sa = qwen_rt.SparseAttention(budget_tokens=96, sink_tokens=16, window_tokens=32)
    for sparse, staging in ((None, 0), (sa, 0), (sa, 12)):
        ref = fresh_gen(folder, sparse_attention=sparse, **base)
        eb = 4 if dtype == "float32" else 2  # the KV cache holds the activations' dtype
        # A page's summary rows (sparse) take a token's K/V bytes, on the device for the host's pages too.
        # 8 frames: 8 pages of 16 rows, or 8 + ceil(60 / 17) pages of 17 (the host pages' summaries take the rest).
        # Staging: its 12 frames and a frame's worth of map.
        frames = 8 + 4 + (staging + 1 if staging else 0)
        dev_bytes = M.kv_bytes(folder, 1, 1, eb) * (frames * 17 if sparse else 8 * 16)
        gen = fresh_gen(folder, sparse_attention=sparse, kv_cache_memory=dev_bytes, kv_staging_pages=staging,
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
        assert st["staging_pages"] == staging and (st["staging_reads"] > st["staging_copies"] > 0) == bool(staging)
