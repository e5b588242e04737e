"""The FP8 KV cache (Generator(kv_cache_dtype="fp8")) on the CPU, fp32 activations: K/V stored as e4m3 with a scale per
token and kv head (the op tests check the values bit for bit). Here: outputs close to the fp32 cache's, a pool of
~4x the pages in the same bytes, and the properties the exact paths keep with it: batch mates, prefix hits, the host
tier and speculation change no output."""
from __future__ import annotations

import math

import pytest

import models as M

GREEDY = dict(temperature=0.0, ignore_eos=True)
PS = 4
BASE = dict(page_size=PS, max_num_batched_tokens=16, max_batch_size=3, max_model_len=400)


def worst_logprob_gap(got, want):
    """The largest |logprob difference| over the top tokens both runs report, every step of every request."""
    gap = 0.0
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            gap = max([gap] + [abs(a[t] - b[t]) for t in a.keys() & b.keys()])
    return gap


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_fp8_cache_is_close_to_the_fp32_cache(build, fresh_gen, name):
    """The same greedy tokens as the fp32 cache on prompts whose continuations keep a top-2 gap of 0.3, logprobs
    within 0.25 and not equal to them (the fp8 cache was used). e4m3 keeps 3 mantissa bits (up to 6% off an element);
    the tiny random models' logprobs moved by up to ~0.12 at the first token."""
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=21, lengths=[90, 33, 5], max_new=6, margin=0.3)
    want = fresh_gen(folder, **BASE).generate(prompts, max_tokens=6, logprobs=3, **GREEDY)
    got = fresh_gen(folder, kv_cache_dtype="fp8", **BASE).generate(prompts, max_tokens=6, logprobs=3, **GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    gap = worst_logprob_gap(got, want)
    assert 0 < gap < 0.25, gap


def test_fp8_pool_holds_more_pages_in_the_same_bytes(build, fresh_gen):
    folder = build("qwen3_gqa2_tied")
    memory = M.kv_bytes(folder, 40, PS)
    fp32 = fresh_gen(folder, kv_cache_memory=memory, **BASE).stats()
    fp8 = fresh_gen(folder, kv_cache_memory=memory, kv_cache_dtype="fp8", **BASE).stats()
    assert fp32["total_pages"] == 40
    assert fp8["total_pages"] == memory // M.kv_bytes(folder, 1, PS, fp8=True)
    assert fp8["kv_bytes"] == fp8["total_pages"] * M.kv_bytes(folder, 1, PS, fp8=True) <= memory
    info = M.model_info(folder)
    assert fp8["total_pages"] == math.floor(40 * 4 * info["head_dim"] / (info["head_dim"] + 4))


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_fp8_outputs_do_not_depend_on_batch_mates_or_prefix_hits(build, fresh_gen, name):
    """A request's output alone, beside others, and again on its own cached prefix: bit for bit the same (each
    token's scales are its own)."""
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=22, lengths=[70, 41, 12], max_new=8)
    gen = fresh_gen(folder, kv_cache_dtype="fp8", **BASE)
    alone = [gen.generate([p], max_tokens=8, logprobs=2, **GREEDY)[0] for p in prompts]
    together = gen.generate(prompts, max_tokens=8, logprobs=2, **GREEDY)
    again = gen.generate([prompts[0]], max_tokens=8, logprobs=2, **GREEDY)[0]
    for a, t in zip(alone, together):
        assert a.token_ids == t.token_ids and a.logprobs == t.logprobs
    assert again.cached_tokens > 0
    assert again.token_ids == alone[0].token_ids and again.logprobs == alone[0].logprobs


def test_fp8_host_tier_equals_the_device_pool(build, fresh_gen):
    """Pages (with their scales) moved to the host tier and read there: the output of a pool that holds them all."""
    folder = build("qwen3_gqa2_tied")
    prompts = M.pick_prompts(folder, seed=23, lengths=[250, 120], max_new=10)
    ref = fresh_gen(folder, kv_cache_dtype="fp8", **BASE)
    one = M.kv_bytes(folder, 1, PS, fp8=True)
    gen = fresh_gen(folder, kv_cache_dtype="fp8", kv_cache_memory=14 * one, kv_offload_memory=150 * one, **BASE)
    want = ref.generate(prompts, max_tokens=10, logprobs=2, **GREEDY)
    got = gen.generate(prompts, max_tokens=10, logprobs=2, **GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.logprobs for g in got] == [w.logprobs for w in want]
    st = gen.stats()
    assert st["device_pages"] == 14 and st["kv_bytes_to_host"] >= 40 * one


def test_fp8_with_sparse_attention(build, fresh_gen):
    """Sparse decode over an fp8 cache (summaries of the keys as attention reads them): a budget as large as the
    context gives the dense fp8 output; a small one selects and still runs to the end."""
    import qwen_rt

    folder = build("qwen3_gqa2_tied")
    prompts = M.pick_prompts(folder, seed=24, lengths=[150, 60], max_new=8)
    dense = fresh_gen(folder, kv_cache_dtype="fp8", **BASE).generate(prompts, max_tokens=8, logprobs=1, **GREEDY)
    wide = qwen_rt.SparseAttention(budget_tokens=200, sink_tokens=4, window_tokens=8)
    got = fresh_gen(folder, kv_cache_dtype="fp8", sparse_attention=wide, **BASE).generate(
        prompts, max_tokens=8, logprobs=1, **GREEDY)
    assert [g.token_ids for g in got] == [d.token_ids for d in dense]
    assert [g.logprobs for g in got] == [d.logprobs for d in dense]
    narrow = qwen_rt.SparseAttention(budget_tokens=32, sink_tokens=4, window_tokens=8)
    gen = fresh_gen(folder, kv_cache_dtype="fp8", sparse_attention=narrow, **BASE)
    out = gen.generate(prompts, max_tokens=8, **GREEDY)
    assert all(len(o.token_ids) == 8 for o in out) and gen.stats()["sparse_rows"] > 0


def test_fp8_speculation_equals_plain_decoding(build, fresh_gen):
    folder = build("qwen35_hybrid+mtp_echo")
    prompts = M.pick_prompts(folder, seed=25, lengths=[40, 9], max_new=10)
    plain = fresh_gen(folder, kv_cache_dtype="fp8", **BASE).generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    gen = fresh_gen(folder, kv_cache_dtype="fp8", speculative_tokens=2, **BASE)
    spec = gen.generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert [s.logprobs for s in spec] == [p.logprobs for p in plain]
    assert gen.stats()["spec_accepted"] > 0


def test_kv_cache_dtype_is_checked(build, fresh_gen):
    folder = build("qwen3_gqa2_tied")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        fresh_gen(folder, kv_cache_dtype="int4", **BASE)
    with pytest.raises(TypeError, match="kv_cache_dtype"):
        fresh_gen(folder, kv_cache_dtype=8, **BASE)


def cuda_or_skip():
    from qwen_rt import _core

    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device (or the CUDA plugin is missing)")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3_hd64_gqa4", "qwen35_hd256", "qwen3_hd128_gqa2"])
def test_cuda_fp8_cache_equals_the_cpu(build, fresh_gen, name):
    """fp32 activations: the GPU quantizes K/V as the CPU does (a value either side of a rounding boundary aside), so
    the same greedy tokens and logprobs within 2e-2; in bf16 the tokens of the bf16 cache, prefill (tile kernel) and
    decode (the decode kernel at head_dim 128/256, the rows kernel at 64) alike."""
    cuda_or_skip()
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=26, lengths=[300, 70, 9], max_new=8, margin=0.3)
    kw = dict(page_size=16, max_num_batched_tokens=64, max_batch_size=3, max_model_len=400, kv_cache_dtype="fp8")
    cpu = fresh_gen(folder, **kw).generate(prompts, max_tokens=8, logprobs=2, **GREEDY)
    gpu = fresh_gen(folder, device="cuda", dtype="float32", **kw).generate(prompts, max_tokens=8, logprobs=2, **GREEDY)
    assert [g.token_ids for g in gpu] == [c.token_ids for c in cpu]
    assert worst_logprob_gap(gpu, cpu) < 2e-2
    kw16 = dict(kw, device="cuda", dtype="bfloat16")
    bf16 = fresh_gen(folder, **dict(kw16, kv_cache_dtype="auto")).generate(prompts, max_tokens=8, **GREEDY)
    fp8 = fresh_gen(folder, **kw16).generate(prompts, max_tokens=8, **GREEDY)
    assert [f.token_ids for f in fp8] == [b.token_ids for b in bf16]


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen3_hd128_gqa2", "qwen35_hd256"])
def test_cuda_fp8_host_tier_and_sparse_equal_the_device_pool(build, fresh_gen, name):
    """On the GPU with an fp8 cache: the host tier (pages and scales read in place) and sparse decode with a budget
    as large as the context give the plain pool's output; one request at a time (the GEMMs change with the batch)."""
    import qwen_rt

    cuda_or_skip()
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=27, lengths=[300, 120], max_new=10)
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, max_num_batched_tokens=64, max_batch_size=2,
              max_model_len=400, kv_cache_dtype="fp8")
    one = M.kv_bytes(folder, 1, 16, fp8=True)
    ref = fresh_gen(folder, **kw)
    host = fresh_gen(folder, kv_cache_memory=12 * one, kv_offload_memory=60 * one, **kw)
    wide = fresh_gen(folder, sparse_attention=qwen_rt.SparseAttention(budget_tokens=512, sink_tokens=16,
                                                                       window_tokens=32), **kw)
    for p in prompts:
        want = ref.generate([p], max_tokens=10, logprobs=1, **GREEDY)[0]
        for gen in (host, wide):
            got = gen.generate([p], max_tokens=10, logprobs=1, **GREEDY)[0]
            assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert host.stats()["kv_bytes_to_host"] > 0
