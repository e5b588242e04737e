"""The CPU backend's ops (through qwen_rt._core.OpHarness) against float64 numpy references.

Weights given with w_dtype bfloat16/float16 are rounded to that dtype by the op; the references
use the same rounded weights, so the tolerances stay those of fp32 arithmetic.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qwen_rt import _core

ROWS = [1, 3, 17, 129]
COLS = [5, 64, 100]
W_DTYPES = ["float32", "bfloat16", "float16"]


@pytest.fixture(scope="module")
def h():
    return _core.OpHarness("cpu", "float32")


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def rounded(w, w_dtype):
    """w as the op sees it after conversion to w_dtype, back in float64."""
    if w_dtype == "float32":
        return np.asarray(w, np.float32).astype(np.float64)
    if w_dtype == "float16":
        return np.asarray(w, np.float32).astype(np.float16).astype(np.float64)
    if w_dtype == "bfloat16":
        return torch.from_numpy(np.asarray(w, np.float32)).to(torch.bfloat16).double().numpy()
    raise ValueError(w_dtype)


def f64(x):
    return np.asarray(x, np.float64)


def close(got, ref, atol, rtol=1e-5):
    got = np.asarray(got)
    assert got.dtype == np.float32, got.dtype
    assert got.shape == np.shape(ref), (got.shape, np.shape(ref))
    np.testing.assert_allclose(f64(got), ref, rtol=rtol, atol=atol)


def ref_rms(x, w, eps, zc):
    x = f64(x)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * ((1.0 + w) if zc else w)


# --- elementwise / norms -----------------------------------------------------------------------------

@pytest.mark.parametrize("w_dtype", W_DTYPES)
def test_embedding(h, w_dtype):
    rng = np.random.default_rng(1)
    for vocab, cols in [(7, 5), (300, 64), (1000, 100)]:
        table = rnd(rng, vocab, cols)
        for n in ROWS:
            ids = rng.integers(0, vocab, size=n).astype(np.int32)
            ids[0] = vocab - 1
            out = h.embedding(ids, table, w_dtype)
            close(out, rounded(table, w_dtype)[ids], atol=0, rtol=0)


@pytest.mark.parametrize("w_dtype", W_DTYPES)
@pytest.mark.parametrize("zc", [False, True])
def test_rms_norm(h, w_dtype, zc):
    rng = np.random.default_rng(2)
    for n in ROWS:
        for c in COLS:
            x = rnd(rng, n, c, scale=3.0)
            w = rnd(rng, c, scale=0.5) + (0.0 if zc else 1.0)
            for eps in (1e-6, 1e-2):
                out = h.rms_norm(x, w, eps, zc, w_dtype)
                close(out, ref_rms(x, rounded(w, w_dtype), eps, zc), atol=1e-5)


def test_rms_norm_reference_is_transformers():
    """The reference above is transformers' Qwen3RMSNorm (guards the test itself)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    rng = np.random.default_rng(3)
    x, w = rnd(rng, 5, 64), rnd(rng, 64)
    m = Qwen3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(w))
        ref = m(torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(ref_rms(x, f64(w), 1e-6, False), ref, atol=1e-5)


@pytest.mark.parametrize("w_dtype", W_DTYPES)
@pytest.mark.parametrize("zc", [False, True])
def test_add_rms_norm(h, w_dtype, zc):
    rng = np.random.default_rng(4)
    for n in ROWS:
        for c in COLS:
            res, x = rnd(rng, n, c, scale=2.0), rnd(rng, n, c)
            w = rnd(rng, c, scale=0.5) + (0.0 if zc else 1.0)
            r_out, out = h.add_rms_norm(res, x, w, 1e-6, zc, w_dtype)
            s = f64(res) + f64(x)
            close(r_out, s, atol=1e-6)
            close(out, ref_rms(s, rounded(w, w_dtype), 1e-6, zc), atol=1e-5)


@pytest.mark.parametrize("w_dtype", W_DTYPES)
@pytest.mark.parametrize("zc", [False, True])
def test_head_rms_norm(h, w_dtype, zc):
    rng = np.random.default_rng(5)
    for n in ROWS:
        for heads, hd in [(1, 5), (4, 16), (3, 24), (2, 128)]:
            x = rnd(rng, n, heads * hd, scale=2.0)
            w = rnd(rng, hd, scale=0.5) + (0.0 if zc else 1.0)
            out = h.head_rms_norm(x, hd, w, 1e-6, zc, w_dtype)
            ref = ref_rms(x.reshape(n, heads, hd), rounded(w, w_dtype), 1e-6, zc).reshape(n, -1)
            close(out, ref, atol=1e-5)


# --- rope ----------------------------------------------------------------------------------------

def rope_table(max_pos, rot_dim, theta=1e6, factor=1.0):
    inv = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang) * factor, np.sin(ang) * factor], 1).astype(np.float32)


def ref_rope(x, head_dim, positions, cs):
    x = f64(x)
    n = x.shape[0]
    rot = cs.shape[1]
    xh = x.reshape(n, -1, head_dim).copy()
    cos = f64(cs[positions, : rot // 2])[:, None, :]
    sin = f64(cs[positions, rot // 2:])[:, None, :]
    x1, x2 = xh[..., : rot // 2].copy(), xh[..., rot // 2: rot].copy()
    xh[..., : rot // 2] = x1 * cos - x2 * sin
    xh[..., rot // 2: rot] = x2 * cos + x1 * sin
    return xh.reshape(n, -1)


def test_rope_reference_is_transformers():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    rng = np.random.default_rng(6)
    n, heads, hd = 7, 3, 16
    cs = rope_table(64, hd)
    pos = rng.integers(0, 64, size=n)
    x = rnd(rng, n, heads * hd)
    cos = np.concatenate([cs[pos, : hd // 2]] * 2, -1)
    sin = np.concatenate([cs[pos, hd // 2:]] * 2, -1)
    q = torch.from_numpy(x.reshape(1, n, heads, hd)).transpose(1, 2)  # [b, heads, seq, hd]
    ref, _ = apply_rotary_pos_emb(q, q, torch.from_numpy(cos)[None], torch.from_numpy(sin)[None])
    ref = ref.transpose(1, 2).reshape(n, -1).double().numpy()
    np.testing.assert_allclose(ref_rope(x, hd, pos, cs), ref, atol=1e-6)


@pytest.mark.parametrize("heads,head_dim,rot_dim", [(1, 8, 8), (4, 16, 16), (3, 24, 24),
                                                    (2, 128, 128), (4, 32, 8), (2, 64, 16)])
def test_rope(h, heads, head_dim, rot_dim):
    rng = np.random.default_rng(7)
    cs = rope_table(300, rot_dim, factor=1.1)
    for n in ROWS:
        x = rnd(rng, n, heads * head_dim)
        pos = rng.integers(0, 300, size=n).astype(np.int32)
        pos[0] = 0
        out = h.rope(x, head_dim, pos, cs)
        close(out, ref_rope(x, head_dim, pos, cs), atol=1e-5)


# --- linear, silu, add, gather ---------------------------------------------------------------

@pytest.mark.parametrize("w_dtype", W_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(h, w_dtype, bias):
    rng = np.random.default_rng(8)
    for n in ROWS:
        for k in [5, 64, 100, 257]:
            for m in [1, 5, 64, 100]:
                x = rnd(rng, n, k)
                w = rnd(rng, m, k, scale=1.0 / math.sqrt(k))
                # Bias exactly representable in every w_dtype: whether the op rounds it or not.
                b = rounded(rnd(rng, m), "bfloat16").astype(np.float32) if bias else None
                out = h.linear(x, w, b, w_dtype)
                # Contract (ops.h): with bf16 weights the products are of bf16 values (x rounded too).
                xs = rounded(x, "bfloat16") if w_dtype == "bfloat16" else f64(x)
                ref = xs @ rounded(w, w_dtype).T
                if bias:
                    ref = ref + f64(b)
                close(out, ref, atol=2e-5 * math.sqrt(k) / 8 + 1e-6)


@pytest.mark.parametrize("w_dtype", W_DTYPES)
def test_linear_rows_do_not_depend_on_the_batch(h, w_dtype):
    """Every row of x @ w^T equals the same row computed alone, bit for bit, whatever tile the batch's row
    count picks (few rows, 5-15 rows, 16-23 rows and 24+ rows tile differently: from 16 rows 16-bit weights are
    widened to fp32 by blocks, and from 24 rows x and the weights are packed for outer products, x by tiles of 12
    or 6 rows with a shorter last tile): every path runs each output's 16 lane chains in K order, sums them in
    one order and adds a row's tail (K % 16) by fma."""
    rng = np.random.default_rng(21)
    for k, m in [(768, 50), (100, 37), (2048, 19)]:
        x = rnd(rng, 40, k)
        w = rnd(rng, m, k, scale=1.0 / math.sqrt(k))
        alone = np.concatenate([np.asarray(h.linear(x[i:i + 1], w, None, w_dtype)) for i in range(40)])
        for n in (2, 3, 4, 7, 8, 13, 16, 17, 24, 31, 40):
            np.testing.assert_array_equal(np.asarray(h.linear(x[:n], w, None, w_dtype)), alone[:n],
                                          err_msg=f"{n} rows, k {k}")
    # No columns (K = 0) at a prefill's row count: the bias alone.
    b = rnd(rng, 5)
    np.testing.assert_array_equal(np.asarray(h.linear(np.zeros((30, 0), np.float32), np.zeros((5, 0), np.float32),
                                                      b, w_dtype)), np.broadcast_to(b, (30, 5)))
    # Past 1024 rows x is packed by chunks of 1024 rows: rows on either side of the seam, as alone.
    x = rnd(rng, 1100, 80)
    w = rnd(rng, 33, 80, scale=1.0 / math.sqrt(80))
    full = np.asarray(h.linear(x, w, None, w_dtype))
    for i in (0, 1023, 1024, 1099):
        np.testing.assert_array_equal(full[i:i + 1], np.asarray(h.linear(x[i:i + 1], w, None, w_dtype)))


@pytest.mark.parametrize("w_dtype", W_DTYPES)
def test_linear_add(h, w_dtype):
    """out += x @ w^T is exactly linear then add (fp32 sums, product rounded once as before)."""
    rng = np.random.default_rng(11)
    for n in ROWS:
        for k, m in [(5, 7), (64, 100), (257, 33)]:
            x, res = rnd(rng, n, k), rnd(rng, n, m)
            w = rnd(rng, m, k, scale=1.0 / math.sqrt(k))
            out = np.asarray(h.linear_add(x, w, res, w_dtype))
            np.testing.assert_array_equal(out, np.asarray(h.add(res, h.linear(x, w, None, w_dtype))))


def test_norm_linear(h):
    """rms_norm feeding linear (and linear_silu_mul): the CPU composes the two ops exactly."""
    rng = np.random.default_rng(12)
    for n in ROWS:
        for k, m in [(8, 6), (64, 100), (256, 34)]:
            x = rnd(rng, n, k, scale=2.0)
            nw = rnd(rng, k) + 1.0
            w = rnd(rng, m, k, scale=1.0 / math.sqrt(k))
            b = rnd(rng, m)
            normed = np.asarray(h.rms_norm(x, nw, 1e-6, False, "float32"))
            out = np.asarray(h.norm_linear(x, nw, 1e-6, w, b))
            np.testing.assert_array_equal(out, np.asarray(h.linear(normed, w, b, "float32")))
            ours = np.asarray(h.norm_linear_silu_mul(x, nw, 1e-6, w))
            np.testing.assert_array_equal(ours, np.asarray(h.linear_silu_mul(normed, w)))
            close(out, f64(ref_rms(x, nw, 1e-6, False)) @ f64(w).T + f64(b), atol=1e-5)


def test_silu_mul(h):
    rng = np.random.default_rng(9)
    for n in ROWS:
        for i in [1, 5, 64, 100]:
            gu = rnd(rng, n, 2 * i, scale=4.0)
            g, u = f64(gu[:, :i]), f64(gu[:, i:])
            out = h.silu_mul(gu)
            close(out, g / (1.0 + np.exp(-g)) * u, atol=1e-5)


def test_add_and_gather(h):
    rng = np.random.default_rng(10)
    for n in ROWS:
        for c in COLS:
            x, y = rnd(rng, n, c), rnd(rng, n, c)
            close(h.add(x, y), f64(x) + f64(y), atol=1e-6)
            rows = rng.integers(0, n, size=max(1, n // 2 + 1)).astype(np.int32)
            close(h.gather_rows(x, rows), f64(x)[rows], atol=0, rtol=0)


# --- paged attention -------------------------------------------------------------------------

def ref_attention(q, k, v, kc, vc, q_start, ctx_len, page_table, kv_rows, ps, qh, kvh, hd, scale):
    kc, vc = f64(kc).copy(), f64(vc).copy()
    kc[kv_rows], vc[kv_rows] = f64(k), f64(v)
    out = np.zeros(q.shape, np.float64)
    rep = qh // kvh
    for s in range(len(ctx_len)):
        a, b, L = q_start[s], q_start[s + 1], ctx_len[s]
        ql = b - a
        rows = [page_table[s, p // ps] * ps + p % ps for p in range(L)]
        K = kc[rows].reshape(L, kvh, hd)
        Vv = vc[rows].reshape(L, kvh, hd)
        Q = f64(q[a:b]).reshape(ql, qh, hd)
        for hh in range(qh):
            sc = Q[:, hh] @ K[:, hh // rep].T * scale  # [ql, L]
            pos = L - ql + np.arange(ql)
            sc[np.arange(L)[None, :] > pos[:, None]] = -np.inf
            p = np.exp(sc - sc.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            out[a:b, hh * hd:(hh + 1) * hd] = p @ Vv[:, hh // rep]
    return out, kc, vc


def make_attn_case(rng, seqs, ps, qh, kvh, hd, spare_pages=3):
    """seqs: list of (q_len, ctx_len). Pages are handed out in a shuffled order; cache rows not
    holding context are filled with large garbage, so attending to them would show."""
    need = [-(-L // ps) for _, L in seqs]
    max_pages = max(need) + 1
    total = sum(need) + spare_pages
    perm = rng.permutation(total).astype(np.int32)
    page_table = np.zeros((len(seqs), max_pages), np.int32)
    off = 0
    for s, nd in enumerate(need):
        page_table[s, :nd] = perm[off:off + nd]
        page_table[s, nd:] = perm[(off + nd) % total]  # valid ids of other sequences' pages
        off += nd
    width = kvh * hd
    kc = (rng.standard_normal((total * ps, width)) * 30).astype(np.float32)
    vc = (rng.standard_normal((total * ps, width)) * 30).astype(np.float32)
    q_start = np.zeros(len(seqs) + 1, np.int32)
    kv_rows = []
    for s, (ql, L) in enumerate(seqs):
        q_start[s + 1] = q_start[s] + ql
        # The context already cached (positions < L - ql) holds sane values.
        for p in range(L):
            r = page_table[s, p // ps] * ps + p % ps
            kc[r] = rng.standard_normal(width)
            vc[r] = rng.standard_normal(width)
            if p >= L - ql:
                kv_rows.append(r)
    T = int(q_start[-1])
    q = rnd(rng, T, qh * hd)
    k = rnd(rng, T, width)
    v = rnd(rng, T, width)
    ctx = np.array([L for _, L in seqs], np.int32)
    return q, k, v, kc, vc, q_start, ctx, page_table, np.array(kv_rows, np.int32)


ATTN_SEQS = [
    [(1, 1)],                                      # first decode token
    [(7, 7)],                                      # fresh prefill
    [(1, 37), (5, 5), (3, 20), (1, 1), (17, 40)],  # mixed decode / prefill / chunked prefill
    [(1, 16), (1, 17), (1, 64), (16, 16), (2, 33)],  # page boundaries
]


@pytest.mark.parametrize("qh,kvh,hd", [(4, 4, 16), (4, 2, 24), (4, 1, 32), (8, 2, 64),
                                       (2, 1, 128), (3, 3, 5)])
@pytest.mark.parametrize("ps", [4, 16])
def test_attention(h, qh, kvh, hd, ps):
    rng = np.random.default_rng(11)
    scale = 1.0 / math.sqrt(hd) if hd != 24 else 0.3  # any scale, not only 1/sqrt(head_dim)
    for seqs in ATTN_SEQS:
        case = make_attn_case(rng, seqs, ps, qh, kvh, hd)
        q, k, v, kc, vc, q_start, ctx, pt, kv_rows = case
        out, kc_out, vc_out = h.attention(q, k, v, kc, vc, q_start, ctx, pt, kv_rows, ps, qh,
                                          kvh, hd, scale)
        ref, kref, vref = ref_attention(*case, ps, qh, kvh, hd, scale)
        close(kc_out, kref, atol=0, rtol=0)  # only this step's rows change
        close(vc_out, vref, atol=0, rtol=0)
        close(out, ref, atol=2e-5)


@pytest.mark.parametrize("qh,kvh,hd", [(12, 4, 64), (4, 4, 32), (6, 1, 24)])
def test_attention_row_does_not_depend_on_its_step(h, qh, kvh, hd):
    """Long contexts (past the kernel's blocks of keys and of query rows): each row's output equals the reference,
    and is bit-identical to the same row computed alone as a decode step over the same cache."""
    rng = np.random.default_rng(5)
    ps, scale = 16, 1.0 / math.sqrt(hd)
    case = make_attn_case(rng, [(300, 700), (1, 333), (40, 40)], ps, qh, kvh, hd)
    q, k, v, kc, vc, q_start, ctx, pt, kv_rows = case
    out, kc_out, vc_out = h.attention(q, k, v, kc, vc, q_start, ctx, pt, kv_rows, ps, qh, kvh, hd, scale)
    ref, _, _ = ref_attention(*case, ps, qh, kvh, hd, scale)
    close(out, ref, atol=2e-5)
    for r in (0, 1, 15, 16, 17, 127, 128, 129, 255, 299):  # rows of the first sequence at positions 400 + r
        one = h.attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], kc_out, vc_out, np.array([0, 1], np.int32),
                          np.array([401 + r], np.int32), pt[:1], kv_rows[r:r + 1], ps, qh, kvh, hd, scale)[0]
        np.testing.assert_array_equal(np.asarray(one), np.asarray(out)[r:r + 1])


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("qh,kvh,hd", [(4, 2, 24), (8, 2, 64), (2, 1, 128)])
def test_attention_16bit_cache(h, kv_dtype, qh, kvh, hd):
    """A bf16/fp16 KV cache (the CPU's cache for 16-bit weights): the step's K/V rows are rounded into it,
    and the output is exactly that of the fp32 cache holding the same rounded values."""
    rng = np.random.default_rng(13)
    ps = 16
    scale = 1.0 / math.sqrt(hd)
    for seqs in ATTN_SEQS:
        case = make_attn_case(rng, seqs, ps, qh, kvh, hd)
        q, k, v, kc, vc, q_start, ctx, pt, kv_rows = case
        r32 = [rounded(a, kv_dtype).astype(np.float32) for a in (k, v, kc, vc)]
        out, kc_out, vc_out = h.attention(q, k, v, r32[2], r32[3], q_start, ctx, pt, kv_rows, ps, qh, kvh, hd,
                                          scale, kv_dtype=kv_dtype)
        out32, kc32, vc32 = h.attention(q, *r32, q_start, ctx, pt, kv_rows, ps, qh, kvh, hd, scale)
        assert np.array_equal(kc_out, kc32) and np.array_equal(vc_out, vc32)
        assert np.array_equal(out, out32)
        ref, _, _ = ref_attention(q, *r32, q_start, ctx, pt, kv_rows, ps, qh, kvh, hd, scale)
        close(out, ref, atol=2e-5)


def e4m3_heads(x, heads):
    """An fp8 KV cache's rows as attention reads them (ops.h KvLayer): per row and head s = amax / 448 (1 for zeros),
    e4m3(x / s) * s in fp32 (torch's float8_e4m3fn rounding: nearest even; |x / s| <= 448 needs no saturation)."""
    x = np.asarray(x, np.float32)
    g = x.reshape(x.shape[0], heads, -1)
    amax = np.abs(g).max(-1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    q = torch.from_numpy(g / s).to(torch.float8_e4m3fn).float().numpy()
    return (q * s).reshape(x.shape)


@pytest.mark.parametrize("qh,kvh,hd", [(4, 2, 24), (8, 2, 64), (2, 1, 128), (6, 1, 256)])
def test_attention_fp8_cache(h, qh, kvh, hd):
    """An fp8 KV cache: every row written (the cache's and the step's) holds e4m3 values with a scale per row and
    head, exactly e4m3_heads of what was written; the output is attention over those values."""
    rng = np.random.default_rng(17)
    ps = 16
    scale = 1.0 / math.sqrt(hd)
    for seqs in ATTN_SEQS:
        case = make_attn_case(rng, seqs, ps, qh, kvh, hd)
        q, k, v, kc, vc, q_start, ctx, pt, kv_rows = case
        z = next(r for r in range(len(kc)) if r not in set(kv_rows))
        kc[z, :hd] = 0  # a head of zeros: scale 1, zeros back
        out, kc_out, vc_out = h.attention(q, k, v, kc, vc, q_start, ctx, pt, kv_rows, ps, qh, kvh, hd, scale,
                                          kv_dtype="float8_e4m3")
        kq, vq = e4m3_heads(kc, kvh), e4m3_heads(vc, kvh)
        kq[kv_rows], vq[kv_rows] = e4m3_heads(k, kvh), e4m3_heads(v, kvh)
        assert np.array_equal(kc_out, kq) and np.array_equal(vc_out, vq)
        assert not kc_out[z, :hd].any()
        assert 0 < np.abs(kq - np.where(np.isin(np.arange(len(kc)), kv_rows)[:, None], 0, kc)).max()
        ref, _, _ = ref_attention(q, kq[kv_rows], vq[kv_rows], kq, vq, q_start, ctx, pt, kv_rows, ps, qh, kvh, hd,
                                  scale)
        close(out, ref, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_qkv_attention_16bit_cache(h, kv_dtype):
    """The layer's attention from q|k|v with a 16-bit cache (q/k norm, RoPE, the new k / v rounded into the
    cache, attention over it) equals the same steps on an fp32 cache holding the rounded values."""
    rng = np.random.default_rng(14)
    qh, kvh, hd, ps, P = 8, 2, 64, 16, 64
    for seqs in ATTN_SEQS:
        _, _, _, kc, vc, q_start, ctx, pt, kv_rows = make_attn_case(rng, seqs, ps, qh, kvh, hd)
        kc, vc = (rounded(a, kv_dtype).astype(np.float32) for a in (kc, vc))
        T = int(q_start[-1])
        qkv = rnd(rng, T, (qh + 2 * kvh) * hd)
        pos = np.concatenate([np.arange(L - q, L) for q, L in seqs]).astype(np.int32)
        cs = rope_table(P, hd, theta=1000.0)
        qw, kw = 1 + 0.3 * rnd(rng, hd), 1 + 0.3 * rnd(rng, hd)
        scale = 1.0 / math.sqrt(hd)
        out, kco, vco = h.qkv_attention(qkv, kc, vc, q_start, ctx, pt, kv_rows, ps, pos, cs, qh, kvh, hd, scale,
                                        qw, kw, 1e-6, kv_dtype=kv_dtype)
        fin, k32, v32 = h.finish_qkv(qkv, kc, vc, kv_rows, pos, cs, qh, kvh, hd, qw, kw, 1e-6)
        k32, v32 = (rounded(a, kv_dtype).astype(np.float32) for a in (k32, v32))
        assert np.array_equal(kco, k32) and np.array_equal(vco, v32)
        ref, _, _ = h.attention(np.ascontiguousarray(fin[:, :qh * hd]), k32[kv_rows], v32[kv_rows], k32, v32,
                                q_start, ctx, pt, kv_rows, ps, qh, kvh, hd, scale)
        assert np.array_equal(out, ref)


def test_attention_reference_is_transformers():
    """One sequence through the reference equals transformers' eager attention (guards the test)."""
    from transformers.models.qwen3.modeling_qwen3 import repeat_kv

    rng = np.random.default_rng(12)
    qh, kvh, hd, ps, L = 4, 2, 8, 4, 9
    case = make_attn_case(rng, [(L, L)], ps, qh, kvh, hd)
    ref, _, _ = ref_attention(*case, ps, qh, kvh, hd, 0.35)
    q, k, v = (torch.from_numpy(a).double() for a in case[:3])
    Q = q.view(L, qh, hd).transpose(0, 1)[None]
    K = repeat_kv(k.view(L, kvh, hd).transpose(0, 1)[None], qh // kvh)
    Vv = repeat_kv(v.view(L, kvh, hd).transpose(0, 1)[None], qh // kvh)
    sc = Q @ K.transpose(-1, -2) * 0.35
    sc = sc.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
    o = (sc.softmax(-1) @ Vv)[0].transpose(0, 1).reshape(L, -1).numpy()
    np.testing.assert_allclose(ref, o, atol=1e-10)


# --- fill_random -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", W_DTYPES)
def test_fill_random(h, dtype):
    rows, cols = 129, 100
    a = np.asarray(h.fill_random(rows, cols, 5, 0.5, 0.25, dtype))
    b = np.asarray(h.fill_random(rows, cols, 5, 0.5, 0.25, dtype))
    c = np.asarray(h.fill_random(rows, cols, 6, 0.5, 0.25, dtype))
    assert a.shape == (rows, cols) and a.dtype == np.float32
    assert np.array_equal(a, b)
    assert np.mean(a != c) > 0.9
    slack = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    assert a.min() >= -0.25 - slack and a.max() <= 0.75 + slack
    n = a.size
    assert abs(a.mean() - 0.25) < 4 * 0.5 / math.sqrt(3 * n)
    assert abs(a.var() - 0.25 / 3) < 0.01
    assert np.array_equal(rounded(a, dtype), f64(a))  # representable in dtype
    # Rows are not copies of each other (a counter-based generator indexes every element).
    assert len({a[i].tobytes() for i in range(rows)}) == rows


# --- sampling --------------------------------------------------------------------------------

M1, M2, M3 = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9),
              np.uint64(0x94D049BB133111EB))


def _mix64(x):
    x = x + M1
    x = (x ^ (x >> np.uint64(30))) * M2
    x = (x ^ (x >> np.uint64(27))) * M3
    return x ^ (x >> np.uint64(31))


def uniform01(seed, draw, ids):
    """Port of cpp/backend/random.h: uniform01(seed, draw, token id), vectorised over ids."""
    with np.errstate(over="ignore"):
        ids = np.asarray(ids, np.int64).astype(np.uint64)
        s = _mix64(np.full(ids.shape, np.uint64(seed), np.uint64))
        x = _mix64(_mix64(s ^ np.uint64(draw)) ^ ids)
    # float32 arithmetic as in C++: (float(h >> 40) + 0.5f) rounds for values >= 2^23.
    u = (x >> np.uint64(40)).astype(np.float32) + np.float32(0.5)
    return (u * np.float32(1.0 / 16777216.0)).astype(np.float64)


def test_reference_rng_matches_random_h():
    """Values printed by a C++ program calling qrt::uniform01 (guards the port above)."""
    expect = [0.1387093961, 0.1843666732, 0.9763280153, 0.2197858989, 0.2571640313, 0.7877357006,
              0.6935120821, 0.4232114255, 0.9268881083, 0.8323609829, 0.4026509821, 0.7829158306,
              0.2738765776, 0.8761003017, 0.3785912097, 0.3071289957, 0.8410570621, 0.1659224927]
    got = [uniform01(s, d, [t])[0] for s in (0, 1, 12345678901234) for d in (0, 3)
           for t in (0, 1, 383)]
    np.testing.assert_allclose(got, np.float32(expect), rtol=1e-7)


def log_softmax(x):
    x = f64(x)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ref_sample(logits, row):
    """(token, gap between the best and second-best final score) per ops.h sampling semantics."""
    g = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
             presence_penalty=0.0, frequency_penalty=0.0, seed=0, draw=0, seen_tokens=[],
             output_tokens=[], output_counts=[], banned_tokens=[])
    g.update(row)
    x = f64(logits).copy()
    x[list(g["banned_tokens"])] = -np.inf
    r = g["repetition_penalty"]
    for t in g["seen_tokens"]:
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in zip(g["output_tokens"], g["output_counts"]):
        x[t] -= c * g["frequency_penalty"] + g["presence_penalty"]
    if g["temperature"] == 0:
        order = np.argsort(-x, kind="stable")
        return int(order[0]), float(x[order[0]] - x[order[1]])
    x = x / g["temperature"]
    order = np.argsort(-x, kind="stable")
    keep = order[np.isfinite(x[order])]
    if g["top_k"]:
        keep = keep[x[keep] >= x[keep[min(g["top_k"], len(keep)) - 1]]]
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    if g["top_p"] < 1.0:
        n = int(np.searchsorted(np.cumsum(p), g["top_p"]) + 1)
        keep, p = keep[:n], p[:n]
    if g["min_p"] > 0:
        m = p >= g["min_p"] * p.max()
        keep = keep[m]
    score = x[keep] - np.log(-np.log(uniform01(g["seed"], g["draw"], keep)))
    o = np.argsort(-score, kind="stable")
    gap = float(score[o[0]] - score[o[1]]) if len(o) > 1 else np.inf
    return int(keep[o[0]]), gap


def run_sample(h, logits, rows):
    r = h.sample(np.ascontiguousarray(logits, np.float32), rows)
    n = len(rows)
    toks = np.asarray(r["tokens"]).reshape(n)
    lps = np.asarray(r["logprobs"], np.float64).reshape(n)
    tid = np.asarray(r["top_ids"]).reshape(n, -1) if np.size(r["top_ids"]) else np.zeros((n, 0))
    tlp = np.asarray(r["top_logprobs"], np.float64).reshape(tid.shape)
    return toks, lps, tid, tlp


@pytest.mark.parametrize("vocab", [5, 100, 1000])
def test_sample_greedy_and_logprobs(h, vocab):
    rng = np.random.default_rng(13)
    n = 17
    logits = rnd(rng, n, vocab, scale=3.0)
    N = min(4, vocab)
    rows = [dict(temperature=0.0, num_logprobs=N if i % 2 else 0, seed=i) for i in range(n)]
    rows[0]["num_logprobs"] = N
    toks, lps, tid, tlp = run_sample(h, logits, rows)
    ls = log_softmax(logits)
    np.testing.assert_array_equal(toks, np.argmax(logits, -1))
    np.testing.assert_allclose(lps, ls[np.arange(n), toks], atol=1e-5)
    assert tid.shape[1] >= N
    for i, row in enumerate(rows):
        k = row["num_logprobs"]
        if not k:
            continue
        best = np.argsort(-ls[i], kind="stable")[:k]
        np.testing.assert_array_equal(tid[i, :k], best)  # sorted best first
        np.testing.assert_allclose(tlp[i, :k], ls[i, best], atol=1e-5)
        assert np.all(np.diff(tlp[i, :k]) <= 0)


def test_sample_greedy_ties_lowest_id(h):
    logits = np.zeros((2, 10), np.float32)
    logits[0, [7, 3, 9]] = 2.0
    logits[1, :] = -1.0
    toks, _, _, _ = run_sample(h, logits, [dict(temperature=0.0), dict(temperature=0.0)])
    assert list(toks) == [3, 0]


def test_sample_banned_never_chosen(h):
    rng = np.random.default_rng(14)
    V = 50
    base = rnd(rng, V, scale=2.0)
    best3 = [int(t) for t in np.argsort(-base)[:3]]
    logits = np.tile(base, (64, 1))
    rows = [dict(temperature=1.0 if i else 0.0, seed=i, banned_tokens=best3) for i in range(64)]
    toks, lps, _, _ = run_sample(h, logits, rows)
    assert not set(toks.tolist()) & set(best3)
    assert toks[0] == int(np.argsort(-base)[3])  # greedy takes the best allowed one
    # The reported logprob is of the raw logits (the ban does not renormalise it).
    np.testing.assert_allclose(lps, log_softmax(base)[toks], atol=1e-5)


def test_sample_top_k_1_is_greedy(h):
    rng = np.random.default_rng(15)
    n, V = 40, 300
    logits = rnd(rng, n, V, scale=2.0)
    rows = [dict(temperature=float(0.5 + i % 3), top_k=1, seed=1000 + i, draw=i % 5)
            for i in range(n)]
    toks, _, _, _ = run_sample(h, logits, rows)
    np.testing.assert_array_equal(toks, np.argmax(logits, -1))


def test_sample_penalties_greedy(h):
    rng = np.random.default_rng(16)
    V = 30
    base = rnd(rng, V, scale=2.0)
    order = [int(t) for t in np.argsort(-base)]
    cases = [
        dict(repetition_penalty=2.0, seen_tokens=order[:2]),
        dict(repetition_penalty=0.5, seen_tokens=[order[-1], order[1]]),
        dict(presence_penalty=1.5, output_tokens=[order[0]], output_counts=[3]),
        dict(frequency_penalty=0.4, output_tokens=[order[0], order[1]], output_counts=[5, 1]),
        dict(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1,
             seen_tokens=order[:4], output_tokens=order[:3], output_counts=[1, 2, 3]),
    ]
    rows, expect = [], []
    for c in cases:
        row = dict(c, temperature=0.0)
        t, gap = ref_sample(base, row)
        assert gap > 1e-3
        rows.append(row)
        expect.append(t)
    toks, _, _, _ = run_sample(h, np.tile(base, (len(rows), 1)), rows)
    assert list(toks) == expect
    assert len(set(expect)) > 1 and expect != [order[0]] * len(expect)


def _sampled_rows(rng, n):
    rows = []
    for i in range(n):
        rows.append(dict(
            temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5])),
            top_k=int(rng.choice([0, 0, 3, 20])),
            top_p=float(rng.choice([1.0, 1.0, 0.9, 0.5])),
            min_p=float(rng.choice([0.0, 0.0, 0.05, 0.2])),
            seed=int(rng.integers(0, 2**62)),
            draw=int(rng.integers(0, 1000)),
        ))
    return rows


def test_sample_exact_gumbel(h):
    """Seeded draws equal the ops.h recipe exactly (Gumbel-max over the kept tokens with the
    counter-based uniform01(seed, draw, token)); rows whose two best scores are within 1e-3
    are not judged (fp32 vs float64)."""
    rng = np.random.default_rng(17)
    n, V = 200, 257
    logits = rnd(rng, n, V, scale=2.0)
    rows = _sampled_rows(rng, n)
    toks, lps, _, _ = run_sample(h, logits, rows)
    judged = 0
    for i in range(n):
        t, gap = ref_sample(logits[i], rows[i])
        if gap < 1e-3:
            continue
        judged += 1
        assert toks[i] == t, (i, rows[i], toks[i], t)
    assert judged > 150
    np.testing.assert_allclose(lps, log_softmax(logits)[np.arange(n), toks], atol=1e-5)


def test_sample_batch_independent(h):
    """A row's draw depends on (seed, draw, logits), not on its place in the batch."""
    rng = np.random.default_rng(18)
    n, V = 30, 100
    logits = rnd(rng, n, V, scale=1.0)
    rows = _sampled_rows(rng, n)
    toks, _, _, _ = run_sample(h, logits, rows)
    perm = rng.permutation(n)
    toks_p, _, _, _ = run_sample(h, logits[perm], [rows[i] for i in perm])
    np.testing.assert_array_equal(toks_p, toks[perm])
    for i in (0, 7, 29):
        t1, _, _, _ = run_sample(h, logits[i:i + 1], [rows[i]])
        assert t1[0] == toks[i]


def test_sample_distribution(h):
    """8000 seeds on one row: frequencies follow softmax(x / T) restricted by top_k / top_p
    (total variation < 0.04; the noise of 8000 draws is ~0.015)."""
    rng = np.random.default_rng(19)
    V, n = 12, 8000
    base = rnd(rng, V, scale=1.0)
    for T, top_k, top_p in [(1.0, 0, 1.0), (0.6, 5, 1.0), (1.3, 0, 0.7)]:
        rows = [dict(temperature=T, top_k=top_k, top_p=top_p, seed=s, draw=3) for s in range(n)]
        toks, _, _, _ = run_sample(h, np.tile(base, (n, 1)), rows)
        x = f64(base) / T
        order = np.argsort(-x, kind="stable")
        keep = order[:top_k] if top_k else order
        p = np.exp(x[keep] - x[keep].max())
        p /= p.sum()
        if top_p < 1.0:
            m = int(np.searchsorted(np.cumsum(p), top_p) + 1)
            keep, p = keep[:m], p[:m] / p[:m].sum()
        expect = np.zeros(V)
        expect[keep] = p
        freq = np.bincount(toks, minlength=V) / n
        assert set(toks.tolist()) <= set(keep.tolist())
        assert 0.5 * np.abs(freq - expect).sum() < 0.04, (T, top_k, top_p, freq, expect)


@pytest.mark.parametrize("hq,hkv,hd,rot,norm", [(4, 2, 16, 16, True), (6, 2, 8, 4, False), (2, 2, 64, 64, True)])
def test_finish_qkv(h, hq, hkv, hd, rot, norm):
    """q/k head norm + RoPE in place, then k and v written to the cache rows (numpy reference)."""
    rng = np.random.default_rng(hq * 10 + hd)
    T, rows_cache, P = 5, 40, 64
    qkv = rnd(rng, T, (hq + 2 * hkv) * hd)
    kc, vc = rnd(rng, rows_cache, hkv * hd), rnd(rng, rows_cache, hkv * hd)
    kv_rows = rng.permutation(rows_cache)[:T].astype(np.int32)
    pos = rng.integers(0, P, size=T).astype(np.int32)
    cs = rope_table(P, rot, theta=1000.0)
    qw = (1 + 0.3 * rnd(rng, hd)) if norm else None
    kw = (1 + 0.3 * rnd(rng, hd)) if norm else None
    out, kco, vco = h.finish_qkv(qkv, kc, vc, kv_rows, pos, cs, hq, hkv, hd, qw, kw, 1e-6)
    x = f64(qkv).reshape(T, hq + 2 * hkv, hd).copy()
    if norm:
        for sl, w in ((slice(0, hq), qw), (slice(hq, hq + hkv), kw)):
            y = x[:, sl]
            x[:, sl] = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6) * f64(w)
    half = rot // 2
    c, s = f64(cs)[pos][:, None, :half], f64(cs)[pos][:, None, half:]
    a, b = x[:, :hq + hkv, :half].copy(), x[:, :hq + hkv, half:rot].copy()
    x[:, :hq + hkv, :half] = a * c - b * s
    x[:, :hq + hkv, half:rot] = b * c + a * s
    close(out, x.reshape(T, -1), atol=2e-5)
    ref_k, ref_v = f64(kc).copy(), f64(vc).copy()
    ref_k[kv_rows] = x[:, hq:hq + hkv].reshape(T, -1)
    ref_v[kv_rows] = x[:, hq + hkv:].reshape(T, -1)
    close(kco, ref_k, atol=2e-5)
    close(vco, ref_v, atol=2e-5)


def test_worker_threads_take_the_callers_denormal_mode(h):
    """A host that flushes denormals (torch.set_flush_denormal, after the backend's threads started) gets the same
    results from every thread: products in the denormal range flush to zero in each output column, not only in the
    columns the calling thread computed."""
    x = np.full((4, 256), 1e-20, np.float32)
    w = np.full((256, 256), 1e-20, np.float32)  # products 1e-40: denormal
    assert np.all(np.asarray(h.linear(x, w, None, "float32")) > 0)
    assert torch.set_flush_denormal(True)
    try:
        flushed = np.asarray(h.linear(x, w, None, "float32"))
    finally:
        torch.set_flush_denormal(False)
    np.testing.assert_array_equal(flushed, np.zeros_like(flushed))
