"""The CPU backend's Gated DeltaNet ops (causal conv, gated delta rule, gated RMSNorm) and the attention output
gate, against float64 numpy references that are themselves checked against transformers' qwen3_5 functions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from qwen_rt import _core

tq = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.fixture(scope="module")
def h():
    return _core.OpHarness("cpu", "float32")


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# --- float64 references --------------------------------------------------------------------------------

def ref_conv(x, w):
    """silu(causal depthwise conv) of x [L, C] with w [C, K], zeros before the first row."""
    L, C = x.shape
    K = w.shape[1]
    xp = np.concatenate([np.zeros((K - 1, C)), x], 0)
    out = np.stack([(xp[i:i + K] * w.T).sum(0) for i in range(L)])
    return out / (1 + np.exp(-out))


def ref_rule(qkv, a, b, a_log, dt_bias, hk, hv, dk, dv, state=None):
    """The gated delta rule token by token in float64; returns (out [L, hv * dv], state [hv, dk, dv])."""
    L = qkv.shape[0]
    S = np.zeros((hv, dk, dv)) if state is None else state.copy()
    out = np.zeros((L, hv * dv))
    for t in range(L):
        for h in range(hv):
            kh = h // (hv // hk)
            q = qkv[t, kh * dk:(kh + 1) * dk]
            k = qkv[t, hk * dk + kh * dk:hk * dk + (kh + 1) * dk]
            v = qkv[t, 2 * hk * dk + h * dv:2 * hk * dk + (h + 1) * dv]
            q = q / np.sqrt((q * q).sum() + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum() + 1e-6)
            g = -np.exp(a_log[h]) * np.log1p(np.exp(a[t, h] + dt_bias[h]))
            beta = 1 / (1 + np.exp(-b[t, h]))
            S[h] *= np.exp(g)
            delta = (v - S[h].T @ k) * beta
            S[h] += np.outer(k, delta)
            out[t, h * dv:(h + 1) * dv] = S[h].T @ q
    return out, S


def test_references_are_transformers():
    rng = np.random.default_rng(0)
    hk, hv, dk, dv, K, L = 2, 4, 16, 8, 4, 70  # L spans two of transformers' 64-token chunks
    C = 2 * hk * dk + hv * dv
    x, w = rnd(rng, L, C), rnd(rng, C, K, scale=0.5)
    conv = tq.causal_conv1d_fn(torch.from_numpy(x).double().T[None], torch.from_numpy(w).double(),
                               activation="silu")[0].T.numpy()
    np.testing.assert_allclose(ref_conv(x.astype(np.float64), w.astype(np.float64)), conv, rtol=1e-10, atol=1e-12)
    a, b, a_log, dt_bias = rnd(rng, L, hv), rnd(rng, L, hv), rnd(rng, hv, scale=0.5), rnd(rng, hv, scale=0.5)
    out, state = ref_rule(conv, a, b, a_log, dt_bias, hk, hv, dk, dv)
    t = lambda v: torch.from_numpy(np.ascontiguousarray(v))  # noqa: E731
    q = t(conv[:, :hk * dk]).view(1, L, hk, dk)
    k = t(conv[:, hk * dk:2 * hk * dk]).view(1, L, hk, dk)
    v = t(conv[:, 2 * hk * dk:]).view(1, L, hv, dv)
    g = -t(a_log).double().exp() * torch.nn.functional.softplus(t(a).double() + t(dt_bias).double())
    ref_out, ref_state = tq.torch_chunk_gated_delta_rule(q, k, v, g=g[None], beta=t(b).double().sigmoid()[None],
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    # transformers computes in float32 whatever the inputs: compare at fp32's precision.
    np.testing.assert_allclose(out, ref_out[0].reshape(L, -1).double().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, ref_state[0].double().numpy(), rtol=1e-4, atol=1e-5)


# --- the ops, a batch of sequences in two steps -------------------------------------------------------

# (k_heads, v_heads, k_dim, v_dim, kernel); v_heads / k_heads of 1, 2 and 3.
SHAPES = [(1, 1, 8, 8, 4), (2, 4, 16, 8, 4), (2, 6, 8, 16, 3), (3, 3, 5, 7, 2)]


def split_batch(lengths, cut):
    """Two steps over sequences of `lengths`: the first feeds min(cut, len - 1) tokens (at least 1) of each from
    position 0, the second the rest (one token for a decode). Returns [(q_start, ctx_len, [(seq, r0, r1)])]."""
    steps = []
    firsts = [max(1, min(cut, n - 1)) for n in lengths]
    for part in range(2):
        q_start, ctx_len, rows = [0], [], []
        for s, (n, f) in enumerate(zip(lengths, firsts)):
            r0, r1 = (0, f) if part == 0 else (f, n)
            if r1 <= r0:
                continue
            rows.append((s, r0, r1))
            q_start.append(q_start[-1] + r1 - r0)
            ctx_len.append(r1)
        steps.append((np.array(q_start, np.int32), np.array(ctx_len, np.int32), rows))
    return steps


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cut", [1, 3, 9])
def test_causal_conv1d(h, shape, cut):
    hk, hv, dk, dv, K = shape
    C = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(cut)
    lengths = [1 + cut, 2, 13, 5]
    xs = [rnd(rng, n, C) for n in lengths]
    w = rnd(rng, C, K, scale=0.5)
    slots = np.array([3, 0, 2, 1], np.int32)  # sequence s lives in slot slots[s]
    conv_state = rnd(rng, 5, (K - 1) * C)  # garbage: a sequence starting at position 0 must not read it
    outs = [np.zeros((n, C), np.float32) for n in lengths]
    for q_start, ctx_len, rows in split_batch(lengths, cut):
        x = np.concatenate([xs[s][r0:r1] for s, r0, r1 in rows])
        sl = np.array([slots[s] for s, _, _ in rows], np.int32)
        out, conv_state = h.causal_conv1d(x, w, conv_state, q_start, ctx_len, sl, hk, hv, dk, dv, K)
        for i, (s, r0, r1) in enumerate(rows):
            outs[s][r0:r1] = out[q_start[i]:q_start[i + 1]]
    for s, n in enumerate(lengths):
        np.testing.assert_allclose(outs[s], ref_conv(xs[s].astype(np.float64), w.astype(np.float64)),
                                   rtol=1e-5, atol=1e-5)
        # The state holds the last K - 1 inputs (zeros before position 0).
        hist = np.concatenate([np.zeros((K - 1, C), np.float32), xs[s]])[-(K - 1):]
        np.testing.assert_array_equal(conv_state[slots[s]].reshape(K - 1, C), hist)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cut", [1, 4, 17])
def test_gated_delta_rule(h, shape, cut):
    hk, hv, dk, dv, _ = shape
    C = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(10 + cut)
    lengths = [1 + cut, 2, 21, 6]
    qkvs = [rnd(rng, n, C) for n in lengths]
    As, Bs = [rnd(rng, n, hv) for n in lengths], [rnd(rng, n, hv) for n in lengths]
    a_log, dt_bias = rnd(rng, 1, hv, scale=0.5), rnd(rng, 1, hv, scale=0.5)
    slots = np.array([1, 3, 0, 2], np.int32)
    state = rnd(rng, 4, hv * dk * dv)  # garbage: sequences start at position 0
    outs = [np.zeros((n, hv * dv), np.float32) for n in lengths]
    for q_start, ctx_len, rows in split_batch(lengths, cut):
        cat = lambda xs: np.concatenate([xs[s][r0:r1] for s, r0, r1 in rows])  # noqa: E731
        sl = np.array([slots[s] for s, _, _ in rows], np.int32)
        out, state = h.gated_delta_rule(cat(qkvs), cat(As), cat(Bs), a_log, dt_bias, state, q_start, ctx_len, sl,
                                        hk, hv, dk, dv)
        for i, (s, r0, r1) in enumerate(rows):
            outs[s][r0:r1] = out[q_start[i]:q_start[i + 1]]
    for s in range(len(lengths)):
        f = lambda v: v.astype(np.float64)  # noqa: E731
        ref, ref_state = ref_rule(f(qkvs[s]), f(As[s]), f(Bs[s]), f(a_log[0]), f(dt_bias[0]), hk, hv, dk, dv)
        np.testing.assert_allclose(outs[s], ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state[slots[s]].reshape(hv, dk, dv), ref_state, rtol=1e-4, atol=1e-5)


def test_gated_delta_rule_does_not_depend_on_batch_mates(h):
    hk, hv, dk, dv = 2, 4, 16, 8
    C = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(5)
    qkv, a, b = rnd(rng, 9, C), rnd(rng, 9, hv), rnd(rng, 9, hv)
    a_log, dt_bias = rnd(rng, 1, hv), rnd(rng, 1, hv)
    state = np.zeros((3, hv * dk * dv), np.float32)
    alone, _ = h.gated_delta_rule(qkv[:4], a[:4], b[:4], a_log, dt_bias, state, np.array([0, 4], np.int32),
                                  np.array([4], np.int32), np.array([0], np.int32), hk, hv, dk, dv)
    both, _ = h.gated_delta_rule(qkv, a, b, a_log, dt_bias, state, np.array([0, 4, 9], np.int32),
                                 np.array([4, 5], np.int32), np.array([0, 2], np.int32), hk, hv, dk, dv)
    np.testing.assert_array_equal(alone, both[:4])


@pytest.mark.parametrize("rows,heads,hd", [(1, 1, 8), (5, 3, 16), (17, 4, 128)])
def test_gated_rms_norm(h, rows, heads, hd):
    rng = np.random.default_rng(rows)
    x, z, w = rnd(rng, rows, heads * hd), rnd(rng, rows, heads * hd), rnd(rng, 1, hd)
    norm = tq.Qwen3_5RMSNormGated(hd, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w[0]))
        ref = norm(torch.from_numpy(x).double().view(-1, hd), torch.from_numpy(z).double().view(-1, hd))
    np.testing.assert_allclose(h.gated_rms_norm(x, z, w, 1e-6, hd), ref.view(rows, -1).numpy(), rtol=1e-5, atol=1e-5)


def test_sigmoid_mul(h):
    rng = np.random.default_rng(1)
    x, g = rnd(rng, 7, 33), rnd(rng, 7, 33, scale=3)
    np.testing.assert_allclose(h.sigmoid_mul(x, g), x / (1 + np.exp(-g.astype(np.float64))), rtol=1e-6, atol=1e-7)
