"""Sparse decode (qwen_rt.SparseAttention): page summaries, page scores and selection, attention over per-head page
lists, and the Generator with it. The ops are checked against numpy (CPU) and the CPU (CUDA); the Generator's
output equals the dense run wherever every page fits the budget, and with a small budget it selects, stays
independent of its batch mates, and reuses prefix-cached pages' summaries."""
from __future__ import annotations

import math

import numpy as np
import pytest

import models as M
from qwen_rt import _core
from test_cpu_ops import make_attn_case

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_case(rng, seqs, ps, qh, kvh, hd):
    """seqs: (q_len, ctx_len) per sequence: test_cpu_ops' attention case (pages handed out shuffled, rows no sequence
    holds large garbage), its cache holding every context token: (q, k_cache, v_cache, q_start, ctx_len, page_table)."""
    q, _, _, kc, vc, q_start, ctx, pt, _ = make_attn_case(rng, seqs, ps, qh, kvh, hd)
    return q, kc, vc, q_start, ctx, pt


def page_scores(q_row, kc, pt_row, L, ps, h, G, hd):
    """Each page's score for kv head h: max over its query heads of sum max(q mn, q mx) (float64)."""
    n = -(-L // ps)
    out = []
    for c in range(n):
        rows = [pt_row[c] * ps + j for j in range(min(ps, L - c * ps))]
        K = kc[rows][:, h * hd:(h + 1) * hd].astype(np.float64)
        mn, mx = K.min(0), K.max(0)
        Q = q_row[h * G * hd:(h + 1) * G * hd].reshape(G, hd).astype(np.float64)
        out.append(np.max(np.maximum(Q * mn, Q * mx).sum(1)))
    return np.array(out)


def check_lists(case, ps, qh, kvh, hd, budget, sink, window, pages, keys, tol=1e-3):
    """pages/keys are select_pages' lists: the sink, the window and the best candidates (within tol of the
    numpy scores: fp32 may order near-ties differently), in page order; whole tables where nothing is selected."""
    q, kc, vc, q_start, ctx, pt = case
    G = qh // kvh
    for s in range(len(ctx)):
        L, ql = int(ctx[s]), int(q_start[s + 1] - q_start[s])
        n = -(-L // ps)
        for h in range(kvh):
            lst, kk = pages[s * kvh + h], int(keys[0, s * kvh + h])
            if not (ql == 1 and n > budget):
                assert kk == L and np.array_equal(lst[:n], pt[s, :n])
                continue
            k = budget - sink - window
            assert kk == (budget - 1) * ps + (L - (n - 1) * ps)
            assert np.array_equal(lst[:sink], pt[s, :sink])
            assert np.array_equal(lst[sink + k:budget], pt[s, n - window:n])
            chosen = [int(np.where(pt[s, :n] == p)[0][0]) for p in lst[sink:sink + k]]
            assert chosen == sorted(chosen) and len(set(chosen)) == k
            assert all(sink <= c < n - window for c in chosen)
            sc = page_scores(q[q_start[s]], kc, pt[s], L, ps, h, G, hd)
            rest = [c for c in range(sink, n - window) if c not in chosen]
            assert min(sc[chosen]) >= max(sc[rest]) - tol * max(1.0, abs(max(sc[rest])))


def ref_lists_attention(case, ps, qh, kvh, hd, scale, pages, keys):
    """Attention of every row over its (sequence, kv head) list (float64)."""
    q, kc, vc, q_start, ctx, pt = case
    G = qh // kvh
    out = np.zeros(q.shape, np.float64)
    for s in range(len(ctx)):
        a, b = q_start[s], q_start[s + 1]
        for h in range(kvh):
            lst, n_keys = pages[s * kvh + h], int(keys[0, s * kvh + h])
            rows = [lst[j // ps] * ps + j % ps for j in range(n_keys)]
            K = kc[rows][:, h * hd:(h + 1) * hd].astype(np.float64)
            V = vc[rows][:, h * hd:(h + 1) * hd].astype(np.float64)
            for r in range(a, b):
                visible = n_keys - (b - r) + 1
                for g in range(G):
                    hh = h * G + g
                    sc = K[:visible] @ q[r, hh * hd:(hh + 1) * hd].astype(np.float64) * scale
                    p = np.exp(sc - sc.max())
                    out[r, hh * hd:(hh + 1) * hd] = (p / p.sum()) @ V[:visible]
    return out


def summaries_ref(kc, ps, pages_used):
    """The summary rows of the pages in pages_used: (page, min row, max row)."""
    return {p: (kc[p * ps:(p + 1) * ps].min(0), kc[p * ps:(p + 1) * ps].max(0)) for p in pages_used}


SEQS = [
    [(1, 70)],                                  # one decode row, selects
    [(1, 70), (1, 33), (5, 60), (1, 200)],      # decode rows that select and one that fits, a prefill chunk
    [(1, 49), (1, 48), (1, 47)],                # around the budget
]


@pytest.fixture(scope="module")
def cpu():
    return _core.OpHarness("cpu", "float32")


@pytest.mark.parametrize("qh,kvh,hd", [(4, 2, 16), (6, 1, 32), (2, 2, 8)])
@pytest.mark.parametrize("budget,sink,window", [(12, 1, 2), (3, 0, 1)])
def test_select_pages_and_attention_cpu(cpu, qh, kvh, hd, budget, sink, window):
    ps = 4
    rng = np.random.default_rng(qh * 7 + budget)
    scale = 1 / math.sqrt(hd)
    for seqs in SEQS:
        case = make_case(rng, seqs, ps, qh, kvh, hd)
        q, kc, vc, q_start, ctx, pt = case
        out, pages, keys, summary = cpu.sparse_attention(q, kc, vc, q_start, ctx, pt, ps, qh, kvh, hd, scale, budget,
                                                         sink, window)
        # Summaries: the full pages' min and max rows (every page a sequence holds whole).
        for s, (_, L) in enumerate(seqs):
            for c in range(L // ps):
                p = int(pt[s, c])
                assert np.array_equal(summary[2 * p], kc[p * ps:(p + 1) * ps].min(0))
                assert np.array_equal(summary[2 * p + 1], kc[p * ps:(p + 1) * ps].max(0))
        check_lists(case, ps, qh, kvh, hd, budget, sink, window, pages, keys)
        np.testing.assert_allclose(out, ref_lists_attention(case, ps, qh, kvh, hd, scale, pages, keys), atol=2e-5)


def test_budget_covering_every_page_is_dense_attention_bit_for_bit(cpu):
    """Where no sequence has more pages than the budget, the lists are the page tables and the output is the
    dense attention's, bit for bit."""
    ps, qh, kvh, hd = 4, 4, 2, 16
    rng = np.random.default_rng(3)
    for seqs in SEQS:
        case = make_case(rng, seqs, ps, qh, kvh, hd)
        q, kc, vc, q_start, ctx, pt = case
        budget = int(pt.shape[1])  # every sequence fits
        out, pages, keys, _ = cpu.sparse_attention(q, kc, vc, q_start, ctx, pt, ps, qh, kvh, hd, 0.25, budget, 1, 1)
        rows = np.concatenate([[pt[s, j // ps] * ps + j % ps for j in range(L - ql, L)]
                               for s, (ql, L) in enumerate(seqs)]).astype(np.int32)
        dense, _, _ = cpu.attention(q, kc[rows], vc[rows], kc, vc, q_start, ctx, pt, rows, ps, qh, kvh, hd, 0.25)
        assert np.array_equal(out, dense)
        assert all(int(keys[0, i]) == int(ctx[i // kvh]) for i in range(len(seqs) * kvh))


@pytest.mark.parametrize("G,hd", [(1, 16), (6, 32)])
@pytest.mark.parametrize("kv_dtype", ["", "float8_e4m3"])
def test_scorer_ranks_a_planted_key_first(cpu, G, hd, kv_dtype):
    """A key planted to match one query head of one kv head puts its page first for that head, wherever the page
    lies among the candidates; the other head, without a planted key, selects something else. Also over an fp8
    cache (summaries of the keys as stored)."""
    ps, kvh, L = 8, 2, 400
    qh = G * kvh
    rng = np.random.default_rng(G)
    n = L // ps
    for target, head, g in [(1, 0, 0), (n // 2, 1, G - 1), (n - 3, 0, G // 2)]:
        case = make_case(rng, [(1, L)], ps, qh, kvh, hd)
        q, kc, vc, q_start, ctx, pt = case
        rows = [pt[0, c] * ps + j for c in range(n) for j in range(ps)]
        kc[rows] *= 0.1
        qv = q[0, (head * G + g) * hd:(head * G + g + 1) * hd]
        kc[pt[0, target] * ps + 3, head * hd:(head + 1) * hd] = 4 * qv
        # budget: the sink page, two window pages and one selected
        _, pages, keys, _ = cpu.sparse_attention(q, kc, vc, q_start, ctx, pt, ps, qh, kvh, hd, 0.1, 4, 1, 2,
                                                 kv_dtype=kv_dtype)
        assert pages[head, 1] == pt[0, target]
        assert pages[1 - head, 1] != pt[0, target]


# --- the Generator --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_budget_above_every_context_equals_dense(build, fresh_gen, name):
    """Budget above every request's length: tokens and logprobs equal those without sparse attention (fp32)."""
    import qwen_rt

    folder = build(name)
    prompts = M.pick_prompts(folder, seed=5, lengths=[40, 9, 70], max_new=8)
    dense = fresh_gen(folder, max_batch_size=4)
    sparse = fresh_gen(folder, max_batch_size=4, sparse_attention=qwen_rt.SparseAttention(budget_tokens=256,
                                                                                         sink_tokens=16,
                                                                                         window_tokens=32))
    a = dense.generate(prompts, max_tokens=8, logprobs=2, **GREEDY)
    b = sparse.generate(prompts, max_tokens=8, logprobs=2, **GREEDY)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.logprobs == y.logprobs
    assert sparse.stats()["sparse_rows"] == 0


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_small_budget_selects_and_is_batch_invariant(build, fresh_gen, name):
    """A 32-token budget over ~100-token contexts: decode rows select (the stats count them), and each request's
    tokens and logprobs are the same alone as beside others (and with a prefix hit)."""
    import qwen_rt

    folder = build(name)
    prompts = M.pick_prompts(folder, seed=9, lengths=[90, 100, 20], max_new=12)
    sa = qwen_rt.SparseAttention(budget_tokens=32, sink_tokens=4, window_tokens=8)
    gen = fresh_gen(folder, max_batch_size=4, page_size=4, sparse_attention=sa)
    together = gen.generate(prompts, max_tokens=12, logprobs=1, **GREEDY)
    st = gen.stats()
    assert st["sparse_rows"] > 0
    assert 0 < st["sparse_pages_attended"] < st["sparse_pages_held"]
    for p, t in zip(prompts, together):
        alone = gen.generate([p], max_tokens=12, logprobs=1, **GREEDY)[0]  # a prefix hit, too
        assert alone.token_ids == t.token_ids
        assert alone.logprobs == t.logprobs
    fresh = fresh_gen(folder, max_batch_size=4, page_size=4, sparse_attention=sa, enable_prefix_caching=False)
    assert fresh.generate(prompts[:1], max_tokens=12, logprobs=1, **GREEDY)[0].logprobs == together[0].logprobs
    # Selection changes what is attended to: the dense run's tokens or logprobs differ somewhere.
    dense = fresh_gen(folder, max_batch_size=4, page_size=4).generate(prompts, max_tokens=12, logprobs=1, **GREEDY)
    assert any(d.logprobs != t.logprobs for d, t in zip(dense, together))


def test_sparse_attention_arguments(build):
    import qwen_rt

    folder = build("qwen3_gqa2_tied")
    with pytest.raises(TypeError, match="SparseAttention"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, sparse_attention={"budget_tokens": 64}))
    with pytest.raises(ValueError, match="budget"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, sparse_attention=qwen_rt.SparseAttention(
            budget_tokens=32, sink_tokens=16, window_tokens=16)))
    with pytest.raises(TypeError, match="budget_tokens"):
        qwen_rt.SparseAttention(budget_tokens=1.5)
    with pytest.raises(ValueError, match="budget_tokens"):
        qwen_rt.SparseAttention(budget_tokens=0)


# --- CUDA against the CPU -------------------------------------------------------------------------------------

def _cuda():
    if _core.cuda_device_count() == 0:
        pytest.skip("no CUDA device (or the CUDA plugin is missing)")


@pytest.mark.cuda
@pytest.mark.parametrize("act", ["float32", "bfloat16"])
@pytest.mark.parametrize("qh,kvh,hd,ps", [(24, 4, 256, 16), (32, 8, 128, 16), (4, 1, 64, 4)])
@pytest.mark.parametrize("kv_dtype", ["", "float8_e4m3"])
@pytest.mark.parametrize("agg", ["0", "1"])
def test_cuda_select_pages_matches_cpu(cpu, act, qh, kvh, hd, ps, kv_dtype, agg, monkeypatch):
    """Summaries, lists and attention against the CPU's; with an fp8 cache the summaries are of the dequantized
    keys (bf16: rounded to bf16, so compared within its rounding) and the lists are not checked against the raw
    keys' rule. The lists' radix select with its plain and its warp-aggregated histogram (QWEN_RT_SELECT_AGG=1)."""
    _cuda()
    monkeypatch.setenv("QWEN_RT_SELECT_AGG", agg)
    from test_cuda_ops import harness, rel, round_to

    gpu = harness("cuda:0", act)
    rng = np.random.default_rng(hd + ps)
    scale = 1 / math.sqrt(hd)
    for seqs in [[(1, 70 * ps)], [(1, 40 * ps + 3), (1, 9 * ps), (7, 30 * ps), (1, 2000)]]:
        case = list(make_case(rng, seqs, ps, qh, kvh, hd))
        q, kc, vc = (round_to(a, act) for a in case[:3])
        case[:3] = q, kc, vc
        args = (q, kc, vc, *case[3:], ps, qh, kvh, hd, scale, 24, 2, 4)
        out, pages, keys, summary = (np.asarray(a) for a in gpu.sparse_attention(*args, kv_dtype=kv_dtype))
        ref_out, ref_pages, ref_keys, ref_summary = (np.asarray(a) for a in cpu.sparse_attention(*args,
                                                                                                 kv_dtype=kv_dtype))
        used = sorted({int(p) for s, (_, L) in enumerate(seqs) for p in case[5][s, :L // ps]})
        rows = [2 * p for p in used] + [2 * p + 1 for p in used]
        if kv_dtype and act != "float32":
            assert rel(summary[rows], ref_summary[rows]) < 4e-3
        else:
            assert np.array_equal(summary[rows], ref_summary[rows])
        assert np.array_equal(keys, ref_keys)
        if not kv_dtype:
            check_lists(tuple(case), ps, qh, kvh, hd, 24, 2, 4, pages, keys, tol=1e-2 if act != "float32" else 1e-4)
        # Where both backends chose the same lists the attention compares; elsewhere near-ties were ordered apart.
        n_keys = keys[0]
        same = np.array([np.array_equal(pages[i, :-(-n_keys[i] // ps)], ref_pages[i, :-(-n_keys[i] // ps)])
                         for i in range(len(pages))])
        assert same.mean() > 0.7, same
        rows = [r for s in range(len(seqs)) if all(same[s * kvh:(s + 1) * kvh])
                for r in range(case[3][s], case[3][s + 1])]
        assert rel(out[rows], ref_out[rows]) < (1e-5 if act == "float32" else 2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_budget_above_every_context_equals_dense_and_small_budget_selects(build, fresh_gen, dtype):
    """On the GPU: a budget above every context gives the dense run's tokens; a small one selects (the stats count
    it). (Outputs alone and beside others are not compared: the GPU's GEMMs still change with the batch.)"""
    _cuda()
    import qwen_rt

    folder = build("qwen3_hd64_gqa4")
    prompts = M.pick_prompts(folder, seed=4, lengths=[120, 60], max_new=10)
    kw = dict(device="cuda", dtype=dtype, max_batch_size=4)
    dense = fresh_gen(folder, **kw).generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    wide = fresh_gen(folder, sparse_attention=qwen_rt.SparseAttention(budget_tokens=512, sink_tokens=16,
                                                                        window_tokens=16), **kw)
    got = wide.generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in dense]
    small = fresh_gen(folder, sparse_attention=qwen_rt.SparseAttention(budget_tokens=48, sink_tokens=16,
                                                                         window_tokens=16), **kw)
    out = small.generate(prompts, max_tokens=10, logprobs=1, **GREEDY)
    assert all(len(c.token_ids) == 10 for c in out)
    st = small.stats()
    assert st["sparse_rows"] > 0 and st["sparse_pages_attended"] < st["sparse_pages_held"]


@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_synthetic_prefill_decodes_a_long_context_in_one_step(build, fresh_gen, name):
    """Benchmarks' synthetic_prefill: a 400-token prompt runs its last token alone (one step before decoding) over
    random stand-in K/V, with sparse attention selecting among the stand-in pages; the output has its length, and
    differs from the real prompt's."""
    import qwen_rt

    folder = build(name)
    (p,) = M.pick_prompts(folder, seed=21, lengths=[400], max_new=6)
    sa = qwen_rt.SparseAttention(budget_tokens=64, sink_tokens=16, window_tokens=16)
    gen = fresh_gen(folder, max_batch_size=2, max_model_len=480, synthetic_prefill=True, sparse_attention=sa)
    out = gen.generate([p], max_tokens=6, **GREEDY)[0]
    st = gen.stats()
    assert len(out.token_ids) == 6 and st["steps"] == 6  # the prompt in one step, then 5 decode steps
    assert st["sparse_rows"] == 6 and st["cached_tokens"] == 0  # the last prompt token selects too
    real = fresh_gen(folder, max_batch_size=2, max_model_len=480).generate([p], max_tokens=6, **GREEDY)[0]
    assert out.token_ids != real.token_ids
