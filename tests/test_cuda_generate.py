"""End to end on the GPU against transformers on the tiny fixtures: greedy tokens equal in fp32 mode,
bf16 logprobs within tolerance, batching invariance in fp32 mode, close() returns device memory."""
from __future__ import annotations

import numpy as np
import pytest

import models as M

pytestmark = pytest.mark.cuda

try:
    from qwen_rt import _core
    _HAVE = _core.cuda_device_count() > 0
except Exception:  # pragma: no cover
    _HAVE = False
if not _HAVE:
    pytest.skip("no CUDA device (or the CUDA plugin is missing)", allow_module_level=True)

GREEDY = dict(temperature=0.0, ignore_eos=True)
# The CUDA attention kernels take the head sizes of real Qwen models (64, 128, 256).
NAMES = ["qwen3_hd128_gqa2", "qwen3_hd64_gqa4", "qwen2_hd64_bias", "qwen35_ratio3", "qwen35_hd256"]


def cuda_gen(folder, **kw):
    import qwen_rt
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_batch_size", 16)
    kw.setdefault("gpu_memory_utilization", 0.05)
    return qwen_rt.Generator(str(folder), device="cuda", progress=False, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_fp32_equals_transformers(build, name):
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=31, lengths=[1, 7, 40], max_new=12)
    with cuda_gen(folder, max_num_batched_tokens=16) as g:  # 40 tokens: chunked prefill
        outs = g.generate(prompts, max_tokens=12, **GREEDY)
    for p, c in zip(prompts, outs):
        assert not M.greedy_mismatch(folder, p, c.token_ids, 12), name


@pytest.mark.parametrize("name", ["qwen3_hd128_gqa2", "qwen2_hd64_bias", "qwen35_hd256"])
def test_bf16_logprobs_close(build, name):
    """bf16 mode: top-5 logprobs of the first token stay as close to transformers' fp32 ones as
    transformers' own bf16 run does (at most twice its error, plus 0.02)."""
    folder = build(name)
    p = M.pick_prompts(folder, seed=5, lengths=[20], max_new=1)[0]
    with cuda_gen(folder, dtype="bfloat16") as g:
        c = g.generate([p], max_tokens=1, logprobs=5, **GREEDY)[0]
    ref = M.log_softmax(M.hf_logits(str(folder), p))
    hf_bf16 = M.log_softmax(M.hf_logits(str(folder), p, dtype="bfloat16"))
    toks = list(c.logprobs[0])
    assert len(toks) >= 5
    ours = max(abs(c.logprobs[0][t] - ref[t]) for t in toks)
    theirs = max(abs(hf_bf16[t] - ref[t]) for t in toks)
    assert ours <= 2 * theirs + 0.02, (ours, theirs)


def test_batch_of_64_equals_alone_fp32(build):
    folder = build("qwen3_hd64_gqa4")
    rng = np.random.default_rng(3)
    lens = [int(x) for x in rng.integers(1, 60, size=64)]
    mts = [int(x) for x in rng.integers(1, 16, size=64)]
    prompts = M.pick_prompts(folder, seed=8, lengths=lens, max_new=16)
    with cuda_gen(folder, max_batch_size=64, max_num_batched_tokens=256) as g:
        reqs = [g.submit(p, max_tokens=m, **GREEDY) for p, m in zip(prompts, mts)]
        batch = [r.result().token_ids for r in reqs]
        alone = [g.generate([p], max_tokens=m, **GREEDY)[0].token_ids for p, m in zip(prompts, mts)]
    assert batch == alone
    for p, m, t in zip(prompts, mts, batch):
        assert not M.greedy_mismatch(folder, p, t, m)


def test_sampling_seeded_same_on_gpu_batches(build):
    folder = build("qwen3_hd128_gqa2")
    prompts = M.pick_prompts(folder, seed=9, lengths=[5, 9, 13], max_new=10)
    kw = dict(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    with cuda_gen(folder) as g:
        together = [c.token_ids for c in g.generate(prompts, **kw)]
        alone = [g.generate([p], **kw)[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.alone
def test_close_returns_device_memory(build):
    torch = pytest.importorskip("torch")
    folder = build("qwen3_hd64_gqa4")
    torch.cuda.init()
    free0, _ = torch.cuda.mem_get_info()
    g = cuda_gen(folder, kv_cache_memory=2 << 30)  # a pool far larger than the tiny model needs
    g.generate([[1, 2, 3]], max_tokens=4, **GREEDY)
    free1, _ = torch.cuda.mem_get_info()
    assert free0 - free1 > 2 << 30  # the KV pool (and the rest) took device memory
    g.close()
    free2, _ = torch.cuda.mem_get_info()
    assert abs(free0 - free2) < 64 << 20, (free0, free1, free2)


@pytest.mark.alone
def test_sampling_scratch_is_taken_before_the_kv_pool():
    """Penalties over a full batch need rows x vocab floats of device scratch: the engine takes it before it sizes
    the KV pool, so a step that first uses penalties allocates nothing (no out-of-memory once the pool is full)."""
    torch = pytest.importorskip("torch")
    import qwen_rt

    torch.cuda.init()
    rows, vocab = 64, 151936  # qwen3-0.6b's vocabulary: the scratch is 39 MB
    prompts = [[i + 1, i + 2, i + 3] for i in range(rows)]
    with qwen_rt.Generator("qwen3-0.6b", load_format="dummy", device="cuda", max_batch_size=rows, max_model_len=256,
                           kv_cache_memory=256 << 20, progress=False) as g:
        g.generate(prompts, max_tokens=4, **GREEDY)  # graphs and attention scratch of the batch
        free0, _ = torch.cuda.mem_get_info()
        outs = g.generate(prompts, max_tokens=4, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
                          temperature=0.7, seed=1)
        free1, _ = torch.cuda.mem_get_info()
    assert all(len(o.token_ids) == 4 for o in outs)
    assert free0 - free1 < rows * vocab * 4 // 2, (free0, free1)


def test_bad_device_index(build):
    import qwen_rt
    with pytest.raises(ValueError, match="cuda"):
        qwen_rt.Generator(str(build("qwen3_hd64_gqa4")), device="cuda:57", progress=False)


def test_greedy_fp32_without_graphs(build):
    """The same steps without CUDA graphs (every decode step launched op by op)."""
    folder = build("qwen3_hd128_gqa2")
    prompts = M.pick_prompts(folder, seed=31, lengths=[1, 7, 40], max_new=12)
    with cuda_gen(folder, cuda_graphs=False) as g:
        outs = g.generate(prompts, max_tokens=12, **GREEDY)
    for p, c in zip(prompts, outs):
        assert not M.greedy_mismatch(folder, p, c.token_ids, 12)



def test_graphs_across_page_table_widths(build):
    """Replayed decode steps take page-table columns by powers of two from 16: contexts that grow across 64 and
    256 tokens (16 and 64 pages of 4) and longer ones, alone and in one batch, give transformers' greedy tokens,
    and the same as without graphs."""
    folder = build("qwen3_hd128_gqa2")
    prompts = M.pick_prompts(folder, seed=33, lengths=[60, 3, 250, 480], max_new=12)
    kw = dict(max_model_len=512, page_size=4)
    with cuda_gen(folder, **kw) as g:
        outs = [c.token_ids for c in g.generate(prompts, max_tokens=12, **GREEDY)]
        alone = [g.generate([p], max_tokens=12, **GREEDY)[0].token_ids for p in prompts]
    with cuda_gen(folder, cuda_graphs=False, **kw) as g:
        plain = [c.token_ids for c in g.generate(prompts, max_tokens=12, **GREEDY)]
    assert outs == alone == plain
    for p, t in zip(prompts, outs):
        assert not M.greedy_mismatch(folder, p, t, 12)


def test_tp1_through_nccl_unchanged(build):
    """TP=1 with an NCCL communicator (the multi-GPU code path on one GPU) gives the same tokens."""
    folder = build("qwen3_hd64_gqa4")
    prompts = M.pick_prompts(folder, seed=12, lengths=[3, 30], max_new=8)
    with cuda_gen(folder) as g:
        ref = [c.token_ids for c in g.generate(prompts, max_tokens=8, **GREEDY)]
    with cuda_gen(folder, comm="nccl") as g:
        got = [c.token_ids for c in g.generate(prompts, max_tokens=8, **GREEDY)]
    assert got == ref


def test_more_ranks_than_devices_is_a_clear_error(build):
    """tensor_parallel_size beyond the GPUs present: a ValueError naming it, before anything is loaded."""
    folder = build("qwen3_hd64_gqa4")
    n = _core.cuda_device_count()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        cuda_gen(folder, tensor_parallel_size=n + 1)
    with cuda_gen(folder) as g:  # the process still makes a working Generator
        assert g.generate([[1, 2, 3]], max_tokens=2, **GREEDY)[0].token_ids


def test_out_of_memory_is_a_clear_error(build):
    """A KV pool larger than the device: an error naming the bytes, and the device stays usable."""
    folder = build("qwen3_hd64_gqa4")
    with pytest.raises((RuntimeError, ValueError), match="bytes"):
        cuda_gen(folder, kv_cache_memory=200 << 30)  # 200 GiB: more than an H200 has
    with cuda_gen(folder) as g:
        assert g.generate([[1, 2, 3]], max_tokens=2, temperature=0.0, ignore_eos=True)[0].token_ids

def test_unsupported_head_dim_is_a_clear_error(build):
    import qwen_rt
    with pytest.raises(ValueError, match="head_dim 24"):
        qwen_rt.Generator(str(build("qwen3_gqa2_tied")), device="cuda", progress=False)


_STALL_SCRIPT = r"""
import sys, time, qwen_rt
folder, comm = sys.argv[1], sys.argv[2]
g = qwen_rt.Generator(folder, device="cuda", dtype="float32", max_batch_size=4, gpu_memory_utilization=0.05,
                      comm=comm, comm_timeout=0.5, progress=False)
t = time.monotonic()
try:
    g.generate([[1, 2, 3]], max_tokens=4, temperature=0.0, ignore_eos=True)
    print("NO ERROR")
except RuntimeError as e:
    print("ERROR", round(time.monotonic() - t, 1), e)
try:
    g.generate([[1, 2, 3]], max_tokens=2)
    print("SECOND OK")
except RuntimeError as e:
    print("SECOND ERROR", e)
t = time.monotonic()
g.close()
print("CLOSED", round(time.monotonic() - t, 1))
"""


@pytest.mark.parametrize("comm", ["auto", "nccl"])
def test_step_that_never_finishes_is_a_bounded_error(build, tmp_path, comm):
    """A step whose device work outlasts comm_timeout (a stall kernel stands in for a hung collective):
    the request fails with an error naming the wait, later requests are refused, close() returns (the
    NCCL communicator is aborted), all within bounded time."""
    import os
    import subprocess
    import sys
    folder = build("qwen3_hd64_gqa4")
    script = tmp_path / "stall.py"
    script.write_text(_STALL_SCRIPT)
    env = dict(os.environ, QWEN_RT_TEST_STALL_MS="3000")
    r = subprocess.run([sys.executable, str(script), str(folder), comm], env=env, capture_output=True, text=True,
                       timeout=120)
    out = r.stdout
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERROR" in out and "did not finish within 0.5 s" in out, out
    assert "NO ERROR" not in out and "SECOND ERROR" in out, out
    assert "CLOSED" in out, out


@pytest.mark.parametrize("name", ["qwen3_hd128_gqa2", "qwen2_hd64_bias"])
def test_prefix_cache_fp32_equals_uncached_and_transformers(build, name):
    """A first request fills the prefix cache; later ones with its 3-page prefix read those pages in their first
    step (chunks after cached pages, and alone a single token after them, which runs as a graph-replayed decode step):
    greedy tokens equal the cache-off run and transformers' in fp32."""
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=12, prefix_len=48, lengths=[4, 1, 23, 16, 40], max_new=10)
    got = {}
    for caching in (True, False):
        with cuda_gen(folder, max_num_batched_tokens=32, enable_prefix_caching=caching) as g:
            outs = (g.generate(prompts[:1], max_tokens=10, **GREEDY) + g.generate(prompts[1:2], max_tokens=10, **GREEDY)
                    + g.generate(prompts[2:], max_tokens=10, **GREEDY))
            got[caching] = [c.token_ids for c in outs]
            assert (g.stats()["cached_tokens"] == 4 * 48) == caching
    assert got[True] == got[False]
    for p, t in zip(prompts, got[True]):
        assert not M.greedy_mismatch(folder, p, t, 10), name


def test_prefix_cache_bf16_logprobs_close(build):
    """bf16: a request whose prefix came from the cache has first-token logprobs as close to transformers' fp32
    ones as transformers' own bf16 run (at most twice its error, plus 0.02)."""
    folder = build("qwen3_hd128_gqa2")
    first, second = M.pick_prompts(folder, seed=14, prefix_len=32, lengths=[3, 11], max_new=1)
    with cuda_gen(folder, dtype="bfloat16") as g:
        g.generate([first], max_tokens=1, **GREEDY)
        c = g.generate([second], max_tokens=1, logprobs=5, **GREEDY)[0]
        assert g.stats()["cached_tokens"] == 32
    ref = M.log_softmax(M.hf_logits(str(folder), second))
    hf_bf16 = M.log_softmax(M.hf_logits(str(folder), second, dtype="bfloat16"))
    toks = list(c.logprobs[0])
    ours = max(abs(c.logprobs[0][t] - ref[t]) for t in toks)
    theirs = max(abs(hf_bf16[t] - ref[t]) for t in toks)
    assert ours <= 2 * theirs + 0.02, (ours, theirs)


@pytest.mark.parametrize("name", ["qwen35_ratio3", "qwen35_hd256"])
def test_hybrid_batch_and_slot_reuse_fp32(build, name):
    """Hybrid models on the GPU: 24 requests of mixed lengths through 4 slots (states started afresh, chunked
    prefill, decode graphs) give transformers' greedy tokens."""
    folder = build(name)
    prompts = M.pick_prompts(folder, seed=41, lengths=[1, 3, 9, 17, 33, 70] * 4, max_new=10)
    with cuda_gen(folder, max_batch_size=4, max_num_batched_tokens=32) as g:
        outs = [r.result() for r in [g.submit(p, max_tokens=10, **GREEDY) for p in prompts]]
    for p, c in zip(prompts, outs):
        msg = M.greedy_mismatch(folder, p, c.token_ids, 10)
        assert not msg, msg
