"""Tensor parallelism on the CPU (ranks are threads, shared-memory all-reduce): TP=2/4 give exactly
the TP=1 greedy tokens in fp32, whatever the KV heads per rank; batching and preemption under TP; a host tier with
sparse decode and staging under TP."""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

import models as M

GREEDY = dict(temperature=0.0, ignore_eos=True)

# kv heads vs ranks: qwen3_gqa4 has 1 KV head (fewer than 2 and 4 ranks: replicated),
# qwen3_gqa2_tied 2 (equal at TP=2, fewer at TP=4), qwen3_mha_untied 4 (more than 2, equal at 4),
# qwen2_gqa4_untied 2 KV heads with q/k/v bias, 8 query heads.
CASES = [(n, tp) for n in ["qwen3_gqa4", "qwen3_gqa2_tied", "qwen3_mha_untied", "qwen2_gqa4_untied"]
         for tp in (2, 4)]


@pytest.mark.parametrize("name,tp", CASES)
def test_tp_matches_single_rank(build, fresh_gen, name, tp):
    folder = build(name)
    rng = np.random.default_rng(7)
    lens = [int(x) for x in rng.integers(1, 40, size=6)]
    prompts = M.pick_prompts(folder, seed=11, lengths=lens, max_new=10)
    one = fresh_gen(folder, tensor_parallel_size=1, max_batch_size=4, max_num_batched_tokens=24)
    many = fresh_gen(folder, tensor_parallel_size=tp, max_batch_size=4, max_num_batched_tokens=24)
    ref = one.generate(prompts, max_tokens=10, **GREEDY)
    got = many.generate(prompts, max_tokens=10, **GREEDY)
    for r, g, p in zip(ref, got, prompts):
        assert g.token_ids == r.token_ids
        assert not M.greedy_mismatch(folder, p, g.token_ids, 10)
    # The weights are split: each rank holds a share, so rank 0 holds fewer bytes.
    assert many.stats()["weight_bytes"] < one.stats()["weight_bytes"]


def test_tp_logprobs_close(build, fresh_gen):
    folder = build("qwen3_gqa2_tied")
    p = M.pick_prompts(folder, seed=3, lengths=[12], max_new=4)[0]
    a = fresh_gen(folder, tensor_parallel_size=1).generate([p], max_tokens=4, logprobs=5, **GREEDY)[0]
    b = fresh_gen(folder, tensor_parallel_size=2).generate([p], max_tokens=4, logprobs=5, **GREEDY)[0]
    for da, db in zip(a.logprobs, b.logprobs):
        assert da.keys() == db.keys()
        for k in da:
            assert abs(da[k] - db[k]) < 1e-4


def test_tp_preemption_keeps_tokens(build, fresh_gen, idle):
    folder = build("qwen3_gqa4")
    gen = fresh_gen(folder, tensor_parallel_size=2, max_batch_size=8, max_model_len=64,
                    kv_cache_memory=M.kv_bytes(folder, 6, 16))
    rng = np.random.default_rng(5)
    lens = [int(x) for x in rng.integers(8, 17, size=12)]  # every request ends at 52..60 tokens = 4 pages
    prompts = M.pick_prompts(folder, seed=21, lengths=lens, max_new=44)
    outs = gen.generate(prompts, max_tokens=44, **GREEDY)
    for p, c in zip(prompts, outs):
        assert not M.greedy_mismatch(folder, p, c.token_ids, 44)
    s = idle(gen)
    assert s["preemptions"] > 0, s
    assert s["free_pages"] == s["total_pages"], s


def test_tp_bad_sizes(build):
    import qwen_rt
    folder = build("qwen3_gqa2_tied")  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        qwen_rt.Generator(str(folder), device="cpu", dtype="float32", tensor_parallel_size=3, progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        qwen_rt.Generator(str(folder), device="cpu", dtype="float32", tensor_parallel_size=0, progress=False)


def test_tp_close_and_restart(build):
    """close() tears the ranks down; a second Generator starts as fast as the first."""
    import qwen_rt
    folder = build("qwen3_mha_untied")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        g = qwen_rt.Generator(str(folder), device="cpu", dtype="float32", tensor_parallel_size=4,
                              progress=False, kv_cache_memory=1 << 20)
        g.generate([[1, 2, 3]], max_tokens=2, **GREEDY)
        g.close()
        times.append(time.perf_counter() - t)
    assert times[2] < 5 * times[0] + 0.5, times


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_dummy_weights_same_model(build, fresh_gen, tp):
    """Random (dummy) weights are drawn per element of the whole matrix, so every TP size runs the
    same model: greedy tokens equal TP=1's."""
    folder = build("qwen2_gqa4_untied")
    kw = dict(load_format="dummy", max_batch_size=4)
    prompts = [[5, 9, 200, 31, 7], [3] * 17, list(range(10, 50))]
    ref = fresh_gen(folder, tensor_parallel_size=1, **kw).generate(prompts, max_tokens=8, logprobs=2, **GREEDY)
    got = fresh_gen(folder, tensor_parallel_size=tp, **kw).generate(prompts, max_tokens=8, logprobs=2, **GREEDY)
    for r, g in zip(ref, got):
        # Logprob gaps guard against near-ties flipping under a different summation order.
        assert g.token_ids == r.token_ids or min(
            abs(a - b) for d in r.logprobs for a in d.values() for b in d.values() if a != b) < 1e-4
        assert g.token_ids[0] == r.token_ids[0]



def test_tp_comm_timeout_bounds_steps_not_loading(build):
    """comm_timeout bounds a step (its collectives and device work), not the load: ranks that take longer than
    it to load still start. A step then either runs or fails with an error naming the bound (the ranks may
    finish within a microsecond of each other, or not), and close() returns either way."""
    import qwen_rt
    folder = build("qwen3_mha_untied")
    g = qwen_rt.Generator(str(folder), device="cpu", dtype="float32", tensor_parallel_size=2, progress=False,
                          kv_cache_memory=1 << 20, comm_timeout=1e-6)
    try:
        for _ in range(3):
            try:
                (c,) = g.generate([[1, 2, 3, 4]], max_tokens=8, **GREEDY)
                assert len(c.token_ids) == 8
            except RuntimeError as e:
                assert re.search("within|aborted|failed|timed out|closed", str(e)), e
    finally:
        t = time.perf_counter()
        g.close()
        assert time.perf_counter() - t < 10


def test_tp_comm_timeout_without_limit(build):
    """comm_timeout=inf (or any bound beyond what a clock holds) waits without a limit; it used to overflow into
    an immediate timeout."""
    import qwen_rt
    folder = build("qwen3_mha_untied")
    for bound in (float("inf"), 1e300):
        with qwen_rt.Generator(str(folder), device="cpu", dtype="float32", tensor_parallel_size=2, progress=False,
                               kv_cache_memory=1 << 20, comm_timeout=bound) as g:
            (c,) = g.generate([[1, 2, 3, 4]], max_tokens=8, **GREEDY)
            assert len(c.token_ids) == 8 and c.finish_reason == "length"


def test_weight_files_unmapped_once_loaded(build, fresh_gen):
    """Four ranks load their shards from one set of mapped files at once: each file is mapped once, and unmapped
    as soon as loading ends (the weights live in the backend's memory), not left behind or kept until close."""
    import os

    folder = build("qwen3_mha_untied")
    shards = [str(p.resolve()) for p in folder.glob("*.safetensors")]
    assert shards

    def mapped():
        with open(f"/proc/{os.getpid()}/maps") as f:
            return sum(any(line.rstrip().endswith(s) for s in shards) for line in f)

    before = mapped()
    for _ in range(3):
        g = fresh_gen(folder, tensor_parallel_size=4, max_batch_size=2)
        assert mapped() == before
        (c,) = g.generate([[1, 2, 3]], max_tokens=4, **GREEDY)
        assert len(c.token_ids) == 4


_FAIL_SCRIPT = r"""
import sys, time
import qwen_rt
folder, tp = sys.argv[1], int(sys.argv[2])
g = qwen_rt.Generator(folder, device="cpu", dtype="float32", tensor_parallel_size=tp, progress=False,
                      kv_cache_memory=1 << 20, comm_timeout=60)
t = time.perf_counter()
try:
    g.generate([[1, 2, 3, 4]], max_tokens=4, temperature=0.0)
    print("NO ERROR")
except RuntimeError as e:
    print("ERROR", round(time.perf_counter() - t, 2), e)
t = time.perf_counter()
g.close()
print("CLOSED", round(time.perf_counter() - t, 2))
"""


@pytest.mark.parametrize("tp,rank", [(2, 0), (2, 1), (4, 2)])
def test_tp_failing_rank_fails_the_step_at_once(build, tmp_path, tp, rank):
    """A rank whose part of a step throws (QWEN_RT_TEST_FAIL_RANK) while the others wait in its collectives: the
    step fails at once with that rank's error, not the aborted collectives' nor after comm_timeout (60 s)."""
    import os
    import subprocess
    import sys
    folder = build("qwen3_mha_untied")
    script = tmp_path / "fail.py"
    script.write_text(_FAIL_SCRIPT)
    env = dict(os.environ, QWEN_RT_TEST_FAIL_RANK=str(rank))
    r = subprocess.run([sys.executable, str(script), str(folder), str(tp)], env=env, capture_output=True, text=True,
                       timeout=150)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln}
    assert "ERROR" in lines and "NO" not in lines, r.stdout
    assert f"rank {rank} failed (QWEN_RT_TEST_FAIL_RANK)" in lines["ERROR"], r.stdout
    assert float(lines["ERROR"].split()[1]) < 20, r.stdout
    assert "CLOSED" in lines and float(lines["CLOSED"].split()[1]) < 20, r.stdout


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_tp_with_a_host_tier_sparse_attention_and_staging(build, fresh_gen, name):
    """TP=2 over a host tier (each rank's pages of its kv heads), sparse decode choosing per kv head and staging
    the chosen host pages on each rank: TP=1's tokens, and each rank stages (the counts sum over ranks)."""
    import qwen_rt

    folder = build(name)
    prompts = M.pick_prompts(folder, seed=19, lengths=[230, 170], max_new=12)
    sa = qwen_rt.SparseAttention(budget_tokens=32, sink_tokens=8, window_tokens=8)
    kw = dict(page_size=4, max_num_batched_tokens=16, max_batch_size=2, max_model_len=300, sparse_attention=sa,
              kv_cache_memory=M.kv_bytes(folder, 120, 4), kv_offload_memory=M.kv_bytes(folder, 200, 4),
              kv_staging_pages=24)
    runs, stats = {}, {}
    for tp in (1, 2):
        gen = fresh_gen(folder, tensor_parallel_size=tp, **kw)
        runs[tp] = gen.generate(prompts, max_tokens=12, **GREEDY)
        stats[tp] = gen.stats()
    assert [c.token_ids for c in runs[2]] == [c.token_ids for c in runs[1]]
    for tp in (1, 2):
        assert stats[tp]["staging_reads"] > stats[tp]["staging_copies"] > 0 and stats[tp]["page_reads_host"] > 0
    # A rank's pages hold half the kv heads: its pool holds twice the pages, so fewer go to the host.
    assert stats[2]["device_pages"] > stats[1]["device_pages"]
