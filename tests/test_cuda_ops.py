"""CUDA backend ops against the CPU reference, through the native op harness (_core.OpHarness).

Every CUDA op runs on random inputs of many shapes (odd sizes too) and is compared with the CPU op on
the same inputs. In bf16/fp16 mode the inputs are rounded to that dtype first, so both backends see
the same values and the CPU result is the fp32 answer to the question the GPU was asked.
Skipped without a CUDA device or without the native module.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

try:
    from qwen_rt import _core
except Exception as exc:  # pragma: no cover - depends on the build
    pytest.skip(f"qwen_rt native module cannot be imported: {exc}", allow_module_level=True)

if not hasattr(_core, "OpHarness"):
    pytest.skip("the native module has no OpHarness", allow_module_level=True)
if _core.cuda_device_count() == 0:
    pytest.skip("no CUDA device (or the CUDA plugin is missing)", allow_module_level=True)

DEVICE = "cuda:0"
ACTS = ["float32", "bfloat16", "float16"]
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x (float32) rounded to dtype and back, round to nearest even like the runtime."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float32":
        return x.copy()
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        u = x.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.astype(np.uint32).view(np.float32)
    raise ValueError(dtype)


def rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.all(np.isfinite(a)), "non-finite values in the CUDA result"
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den > 0 else float(num)


def rand(rng, shape, lo=-1.0, hi=1.0, dtype="float32"):
    return round_to(rng.uniform(lo, hi, size=shape).astype(np.float32), dtype)


_harness: dict = {}


def harness(device: str, act: str):
    key = (device, act)
    if key not in _harness:
        _harness[key] = _core.OpHarness(device, act)
    return _harness[key]


@pytest.fixture(scope="module")
def cpu():
    return harness("cpu", "float32")


# ---------------------------------------------------------------------------------------------
# fill_random: bit-identical across backends
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (257, 1000), (64, 4096)])
@pytest.mark.parametrize("scale,offset", [(0.02, 0.0), (0.1, 1.0), (3.3, -0.7)])
def test_fill_random_bit_identical(cpu, dtype, rows, cols, scale, offset):
    g = harness(DEVICE, "float32")
    a = np.asarray(cpu.fill_random(rows, cols, 1234, scale, offset, dtype))
    b = np.asarray(g.fill_random(rows, cols, 1234, scale, offset, dtype))
    assert a.shape == (rows, cols)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # and it is the documented distribution
    assert np.all(np.abs(a - offset) <= scale + (abs(offset) + scale) * 2.0 ** -7)  # bf16 rounding at most
    if rows * cols > 1000:
        assert abs(float(np.mean(a)) - offset) < 0.05 * scale + 1e-3


def test_fill_random_seed_matters():
    g = harness(DEVICE, "float32")
    a = np.asarray(g.fill_random(4, 100, 1, 1.0, 0.0, "float32"))
    b = np.asarray(g.fill_random(4, 100, 2, 1.0, 0.0, "float32"))
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# norms, rope, elementwise
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows", [1, 3, 17, 257])
@pytest.mark.parametrize("cols", [7, 64, 1000, 4096, 5120, 40000])
@pytest.mark.parametrize("zc", [False, True])
def test_rms_norm(cpu, act, rows, cols, zc):
    rng = np.random.default_rng(rows * 1000 + cols + zc)
    x = rand(rng, (rows, cols), -3, 3, act)
    w = rand(rng, (1, cols), 0.5, 1.5, act)
    ref = np.asarray(cpu.rms_norm(x, w, 1e-6, zc, "float32"))
    out = np.asarray(harness(DEVICE, act).rms_norm(x, w, 1e-6, zc, act))
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows", [1, 3, 17, 257])
@pytest.mark.parametrize("cols", [7, 1000, 4096])
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_add_rms_norm(cpu, act, rows, cols, w_dtype):
    rng = np.random.default_rng(rows * 7 + cols)
    res = rand(rng, (rows, cols), -2, 2, act)
    x = rand(rng, (rows, cols), -2, 2, act)
    w = rand(rng, (1, cols), 0.5, 1.5, w_dtype)
    r_ref, o_ref = (np.asarray(a) for a in cpu.add_rms_norm(res, x, w, 1e-6, False, w_dtype))
    r_out, o_out = (np.asarray(a) for a in harness(DEVICE, act).add_rms_norm(res, x, w, 1e-6, False, w_dtype))
    assert rel(r_out, r_ref) < TOL[act]
    assert rel(o_out, o_ref) < TOL[act]
    # the residual really is residual + x
    assert rel(r_out, res + x) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("zc", [False, True])
def test_head_rms_norm(cpu, act, head_dim, rows, zc):
    rng = np.random.default_rng(head_dim + rows)
    heads = 3
    x = rand(rng, (rows, heads * head_dim), -3, 3, act)
    w = rand(rng, (1, head_dim), 0.5, 1.5, act)
    ref = np.asarray(cpu.head_rms_norm(x, head_dim, w, 1e-6, zc, "float32"))
    out = np.asarray(harness(DEVICE, act).head_rms_norm(x, head_dim, w, 1e-6, zc, act))
    assert rel(out, ref) < TOL[act]
    # every head is normalized on its own
    xr = x.reshape(rows, heads, head_dim).astype(np.float64)
    scale = (1.0 + w[0]) if zc else w[0]
    manual = xr / np.sqrt((xr * xr).mean(-1, keepdims=True) + 1e-6) * scale
    assert rel(out, manual.reshape(rows, -1)) < TOL[act] + 1e-5


def rope_table(positions: int, rot_dim: int, theta: float = 1e6) -> np.ndarray:
    inv = theta ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    f = np.arange(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.cos(f), np.sin(f)], axis=1).astype(np.float32)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (256, 64), (128, 32)])
@pytest.mark.parametrize("rows", [1, 3, 17, 257])
def test_rope(cpu, act, head_dim, rot_dim, rows):
    rng = np.random.default_rng(head_dim * rows + rot_dim)
    heads = 4
    x = rand(rng, (rows, heads * head_dim), -2, 2, act)
    table = rope_table(4096, rot_dim)
    pos = rng.integers(0, 4096, size=rows).astype(np.int32)
    ref = np.asarray(cpu.rope(x, head_dim, pos, table))
    out = np.asarray(harness(DEVICE, act).rope(x, head_dim, pos, table))
    assert rel(out, ref) < TOL[act]
    # dims past rot_dim pass through unchanged
    xr = out.reshape(rows, heads, head_dim)
    assert np.array_equal(xr[:, :, rot_dim:], x.reshape(rows, heads, head_dim)[:, :, rot_dim:])


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("hq,hkv,head_dim,rot_dim", [(4, 2, 64, 64), (32, 8, 128, 128), (24, 4, 256, 64),
                                                     (8, 8, 128, 32)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("rows", [1, 17, 130])
def test_finish_qkv(cpu, act, hq, hkv, head_dim, rot_dim, norm, rows):
    """The fused q/k norm + RoPE + K/V write against the CPU's composition of the single ops
    (rot_dim 32 takes the CUDA composition path)."""
    rng = np.random.default_rng(hq * rows + head_dim + norm)
    cols = (hq + 2 * hkv) * head_dim
    qkv = rand(rng, (rows, cols), -2, 2, act)
    kc = rand(rng, (rows + 40, hkv * head_dim), -1, 1, act)
    vc = rand(rng, (rows + 40, hkv * head_dim), -1, 1, act)
    kv_rows = rng.permutation(rows + 40)[:rows].astype(np.int32)
    pos = rng.integers(0, 4096, size=rows).astype(np.int32)
    table = rope_table(4096, rot_dim)
    qw = rand(rng, (head_dim,), 0.5, 1.5) if norm else None
    kw = rand(rng, (head_dim,), 0.5, 1.5) if norm else None
    ref = cpu.finish_qkv(qkv, kc, vc, kv_rows, pos, table, hq, hkv, head_dim, qw, kw, 1e-6)
    out = harness(DEVICE, act).finish_qkv(qkv, kc, vc, kv_rows, pos, table, hq, hkv, head_dim, qw, kw, 1e-6)
    for a, b in zip(out, ref):
        assert rel(a, b) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows", [1, 3, 17, 257])
@pytest.mark.parametrize("inter", [5, 64, 1000, 3072])
def test_silu_mul(cpu, act, rows, inter):
    rng = np.random.default_rng(rows + inter)
    gu = rand(rng, (rows, 2 * inter), -6, 6, act)
    ref = np.asarray(cpu.silu_mul(gu))
    out = np.asarray(harness(DEVICE, act).silu_mul(gu))
    assert out.shape == (rows, inter)
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (257, 1000), (17, 4096)])
def test_add(cpu, act, rows, cols):
    rng = np.random.default_rng(rows + cols)
    x = rand(rng, (rows, cols), -2, 2, act)
    y = rand(rng, (rows, cols), -2, 2, act)
    ref = np.asarray(cpu.add(x, y))
    out = np.asarray(harness(DEVICE, act).add(x, y))
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("n,hidden", [(1, 64), (3, 17), (257, 1000)])
def test_embedding(cpu, act, w_dtype, n, hidden):
    rng = np.random.default_rng(n + hidden)
    vocab = 300
    table = rand(rng, (vocab, hidden), -1, 1, w_dtype)
    ids = rng.integers(0, vocab, size=n).astype(np.int32)
    ids[0] = vocab - 1
    ref = np.asarray(cpu.embedding(ids, table, w_dtype))
    out = np.asarray(harness(DEVICE, act).embedding(ids, table, w_dtype))
    assert np.array_equal(ref, table[ids])
    if act == "float32":
        assert np.array_equal(out, ref)  # every table dtype converts exactly to fp32
    else:
        assert rel(out, ref) < TOL[act]
        assert np.array_equal(out, round_to(ref, act))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows,cols,n", [(1, 8, 1), (17, 1000, 5), (257, 4096, 64), (33, 7, 33)])
def test_gather_rows(cpu, act, rows, cols, n):
    rng = np.random.default_rng(rows + cols + n)
    x = rand(rng, (rows, cols), -1, 1, act)
    idx = rng.integers(0, rows, size=n).astype(np.int32)
    out = np.asarray(harness(DEVICE, act).gather_rows(x, idx))
    assert np.array_equal(out, x[idx])  # a copy: exact in every dtype
    assert np.array_equal(np.asarray(cpu.gather_rows(x, idx)), x[idx])


# ---------------------------------------------------------------------------------------------
# linear (cuBLASLt)
# ---------------------------------------------------------------------------------------------
LINEAR_SHAPES = [(1, 5, 8), (3, 64, 64), (17, 1000, 333), (257, 64, 1024), (1, 4096, 1024), (64, 1000, 4096)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,n,k", LINEAR_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gemv_rows", ["1", "8"])  # one row (the default from K = 4096), and up to 8
def test_linear_same_dtype(cpu, act, m, n, k, bias, gemv_rows, monkeypatch):
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    rng = np.random.default_rng(m * 131 + n * 7 + k + bias)
    x = rand(rng, (m, k), -1, 1, act)
    w = rand(rng, (n, k), -1, 1, act) / math.sqrt(k)
    w = round_to(w, act)
    b = rand(rng, (1, n), -1, 1, act) if bias else None
    ref = np.asarray(cpu.linear(x, w, b, "float32"))
    out = np.asarray(harness(DEVICE, act).linear(x, w, b, act))
    assert out.shape == (m, n)
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,inter,k", [(1, 8, 64), (3, 100, 512), (8, 1536, 1024), (9, 64, 256), (33, 24, 72)])
@pytest.mark.parametrize("gemv_rows", ["1", "8"])  # one row (the default from K = 4096), and up to 8
def test_linear_silu_mul(cpu, act, m, inter, k, gemv_rows, monkeypatch):
    """The MLP's gate|up projection with silu_mul: equal to CUDA linear then silu_mul (bit for bit: the
    decode GEMV fuses the two), and close to the CPU."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    rng = np.random.default_rng(m * 17 + inter + k)
    x = rand(rng, (m, k), -1, 1, act)
    w = round_to(rand(rng, (2 * inter, k), -1, 1, act) / math.sqrt(k), act)
    h = harness(DEVICE, act)
    out = np.asarray(h.linear_silu_mul(x, w))
    composed = np.asarray(h.silu_mul(np.asarray(h.linear(x, w, None, act))))
    assert out.shape == (m, inter)
    np.testing.assert_array_equal(out, composed)
    ref = np.asarray(cpu.linear_silu_mul(x, w))
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,n,k", [(1, 5, 8), (3, 100, 512), (8, 1024, 4096), (17, 96, 333), (64, 256, 1024)])
@pytest.mark.parametrize("gemv_rows", ["1", "8"])  # one row (the default from K = 4096), and up to 8
def test_linear_add(cpu, act, m, n, k, gemv_rows, monkeypatch):
    """out += x @ w^T (the residual connection): equal to CUDA linear then add where the GEMV fuses them
    (the product rounded first), close to the CPU everywhere (cuBLASLt adds in fp32 before rounding)."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    rng = np.random.default_rng(m * 5 + n + k)
    x = rand(rng, (m, k), -1, 1, act)
    w = round_to(rand(rng, (n, k), -1, 1, act) / math.sqrt(k), act)
    res = rand(rng, (m, n), -2, 2, act)
    h = harness(DEVICE, act)
    out = np.asarray(h.linear_add(x, w, res, act))
    composed = np.asarray(h.add(res, np.asarray(h.linear(x, w, None, act))))
    ref = np.asarray(cpu.linear_add(x, w, res, "float32"))
    assert out.shape == (m, n)
    if act != "float32" and m <= int(gemv_rows) and k % 8 == 0:
        np.testing.assert_array_equal(out, composed)
    assert rel(out, ref) < TOL[act]


NORM_LINEAR_SHAPES = [(1, 8, 64), (2, 100, 512), (5, 1024, 4096), (6, 300, 4096), (8, 64, 4096), (9, 64, 256),
                      (33, 24, 72)]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,n,k", NORM_LINEAR_SHAPES)
@pytest.mark.parametrize("bias,f32_out", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("gain", ["gain", "unit"])
@pytest.mark.parametrize("gemv_rows", ["1", "8"])  # one row (the default from K = 4096), and up to 8
def test_norm_linear(cpu, act, m, n, k, bias, f32_out, gain, gemv_rows, monkeypatch):
    """rms_norm then linear (with a unit gain, the norm runs inside the decode GEMV for the rows it takes):
    close to the CPU composition, and row 0 of m is the same as row 0 alone where the GEMV takes both."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    rng = np.random.default_rng(m * 3 + n + k + bias)
    x = rand(rng, (m, k), -2, 2, act)
    nw = rand(rng, (1, k), 0.5, 1.5, "bfloat16") if gain == "gain" else None
    w = round_to(rand(rng, (n, k), -1, 1, act) / math.sqrt(k), act)
    b = rand(rng, (1, n), -1, 1, act) if bias else None
    h = harness(DEVICE, act)
    out = np.asarray(h.norm_linear(x, nw, 1e-6, w, b, f32_out))
    ref = np.asarray(cpu.norm_linear(x, nw, 1e-6, w, b, True))
    assert out.shape == (m, n)
    assert rel(out, ref) < TOL[act]
    if act != "float32" and m <= int(gemv_rows):  # the GEMV's rows do not depend on each other (fp32: cuBLAS)
        alone = np.asarray(h.norm_linear(x[:1], nw, 1e-6, w, b, f32_out))
        np.testing.assert_array_equal(out[:1], alone)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,inter,k", [(1, 8, 64), (3, 100, 512), (4, 1536, 4096), (8, 256, 4096), (9, 64, 256)])
@pytest.mark.parametrize("gain", ["gain", "unit"])
@pytest.mark.parametrize("gemv_rows", ["1", "8"])  # one row (the default from K = 4096), and up to 8
def test_norm_linear_silu_mul(cpu, act, m, inter, k, gain, gemv_rows, monkeypatch):
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    rng = np.random.default_rng(m * 11 + inter + k)
    x = rand(rng, (m, k), -2, 2, act)
    nw = rand(rng, (1, k), 0.5, 1.5, "bfloat16") if gain == "gain" else None
    w = round_to(rand(rng, (2 * inter, k), -1, 1, act) / math.sqrt(k), act)
    h = harness(DEVICE, act)
    out = np.asarray(h.norm_linear_silu_mul(x, nw, 1e-6, w))
    ref = np.asarray(cpu.norm_linear_silu_mul(x, nw, 1e-6, w))
    assert out.shape == (m, inter)
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("gemv_rows", ["1", "8"])  # one row (the default from K = 4096), and up to 8
def test_scale_columns_folds_a_norm_gain(cpu, act, zc, gemv_rows, monkeypatch):
    """scale_columns multiplies each column by its gain, rounded once to the weights' dtype; a norm with a
    unit gain in front of the scaled weights gives what the norm with the gain gives in front of the
    original ones."""
    rng = np.random.default_rng(17 + zc)
    n, k = 300, 4096
    w = round_to(rand(rng, (n, k), -1, 1, act) / math.sqrt(k), act)
    g = rand(rng, (1, k), 0.5, 1.5, "float32")
    h = harness(DEVICE, act)
    scaled = np.asarray(h.scale_columns(w, g, zc))
    np.testing.assert_array_equal(scaled, round_to(w * ((1.0 + g) if zc else g), act))
    if zc:
        return
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    x = rand(rng, (2, k), -2, 2, act)
    folded = np.asarray(h.norm_linear(x, None, 1e-6, scaled, None, True))
    ref = np.asarray(cpu.norm_linear(x, g, 1e-6, w, None, True))
    assert rel(folded, ref) < TOL[act]


# Odd numbers of 16-byte pieces per row: 24 and 264 (one warp per row) end in a partial round; 4104 (two warps
# per row) has half-rows of different lengths.
@pytest.mark.parametrize("k", [24, 264, 4104])
@pytest.mark.parametrize("n", [1, 5, 133])      # a last group of rows that is partly empty
def test_gemv_rows_do_not_depend_on_the_batch(cpu, k, n, monkeypatch):
    """The decode GEMV (1..8 rows with QWEN_RT_GEMV_ROWS=8, bf16): every row of every epilogue equals the same
    row computed with fewer rows (batch invariance), and is close to the CPU."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", "8")
    act = "bfloat16"
    rng = np.random.default_rng(k * 7 + n)
    x = rand(rng, (8, k), -1, 1, act)
    w = round_to(rand(rng, (2 * n, k), -1, 1, act) / math.sqrt(k), act)
    b = rand(rng, (1, n), -1, 1, act)
    res = rand(rng, (8, n), -2, 2, act)
    h = harness(DEVICE, act)
    ops = {
        "linear": (lambda x_, r_: h.linear(x_, w[:n], b, act), lambda x_, r_: cpu.linear(x_, w[:n], b, "float32"), 8),
        "linear_add": (lambda x_, r_: h.linear_add(x_, w[:n], r_, act),
                       lambda x_, r_: cpu.linear_add(x_, w[:n], r_, "float32"), 8),
        "linear_silu_mul": (lambda x_, r_: h.linear_silu_mul(x_, w), lambda x_, r_: cpu.linear_silu_mul(x_, w), 8),
        "norm_linear": (lambda x_, r_: h.norm_linear(x_, None, 1e-6, w[:n], b, True),
                        lambda x_, r_: cpu.norm_linear(x_, None, 1e-6, w[:n], b, True), 8),
        "norm_linear_silu_mul": (lambda x_, r_: h.norm_linear_silu_mul(x_, None, 1e-6, w),
                                 lambda x_, r_: cpu.norm_linear_silu_mul(x_, None, 1e-6, w), 8),
    }
    for name, (gpu_op, cpu_op, max_rows) in ops.items():
        full = np.asarray(gpu_op(x[:max_rows], res[:max_rows]))
        assert rel(full, np.asarray(cpu_op(x[:max_rows], res[:max_rows]))) < TOL[act], name
        for m in range(1, max_rows):
            part = np.asarray(gpu_op(x[:m], res[:m]))
            np.testing.assert_array_equal(part, full[:m], err_msg=f"{name}: {m} rows against {max_rows}")


# 1032: one warp per row, a round of 4 pieces per lane and one piece left; 3080: two warps per row (halves of 192
# and 193 pieces).
@pytest.mark.parametrize("k", [1032, 3080])
def test_gemv_blocks_walk_several_row_groups(cpu, k, monkeypatch):
    """More row groups than the persistent grid has blocks (9001 rows: 1126 groups of 8 or 2251 of 4 against at most
    4 blocks per SM), so blocks take a second and third group: every row is close to the CPU, and a row's result
    is the same with 1 and 3 x rows."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", "8")
    act, n = "bfloat16", 9001
    rng = np.random.default_rng(k)
    x = rand(rng, (3, k), -1, 1, act)
    w = round_to(rand(rng, (2 * n, k), -1, 1, act) / math.sqrt(k), act)
    h = harness(DEVICE, act)
    for name, gpu_op, cpu_op in (
        ("linear", lambda x_: h.linear(x_, w[:n], None, act), lambda x_: cpu.linear(x_, w[:n], None, "float32")),
        ("linear_silu_mul", lambda x_: h.linear_silu_mul(x_, w), lambda x_: cpu.linear_silu_mul(x_, w)),
    ):
        three = np.asarray(gpu_op(x))
        assert rel(three, np.asarray(cpu_op(x))) < TOL[act], name
        np.testing.assert_array_equal(np.asarray(gpu_op(x[:1])), three[:1], err_msg=name)


@pytest.mark.parametrize("k", [1024, 3072])
def test_gemv_takes_up_to_4_short_rows_by_default(cpu, k, monkeypatch):
    """Without QWEN_RT_GEMV_ROWS, rows of at most 3072 go to the GEMV up to 4 at a time: the fp32 results of
    2..4 rows equal the one-row GEMV's bit for bit (cuBLASLt sums in another order), and are close to the CPU."""
    monkeypatch.delenv("QWEN_RT_GEMV_ROWS", raising=False)
    act = "bfloat16"
    rng = np.random.default_rng(k)
    x = rand(rng, (4, k), -1, 1, act)
    w = round_to(rand(rng, (96, k), -1, 1, act) / math.sqrt(k), act)
    h = harness(DEVICE, act)
    one = np.concatenate([np.asarray(h.norm_linear(x[m:m + 1], None, 1e-6, w, None, True)) for m in range(4)])
    assert rel(one, np.asarray(cpu.norm_linear(x, None, 1e-6, w, None, True))) < TOL[act]
    for m in (2, 3, 4):
        np.testing.assert_array_equal(np.asarray(h.norm_linear(x[:m], None, 1e-6, w, None, True)), one[:m])


@pytest.mark.parametrize("w_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k", LINEAR_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_f32_act_16bit_weights(cpu, w_dtype, m, n, k, bias):
    rng = np.random.default_rng(m + n + k)
    x = rand(rng, (m, k), -1, 1, "float32")
    w = rand(rng, (n, k), -1, 1, w_dtype)
    b = rand(rng, (1, n), -1, 1, w_dtype) if bias else None
    ref = np.asarray(cpu.linear(x, w, b, w_dtype))
    out = np.asarray(harness(DEVICE, "float32").linear(x, w, b, w_dtype))
    assert rel(out, ref) < 1e-5  # fp32 math on exactly the same weight values


def test_linear_fp32_is_not_tf32(cpu):
    # 1 + 2^-12 (+ tiny) rounds to 1.0 in TF32 (10 mantissa bits): a TF32 GEMM would be off by ~5e-4.
    rng = np.random.default_rng(5)
    x = (1.0 + 2.0 ** -12 + rng.integers(0, 64, size=(8, 512)) * 2.0 ** -22).astype(np.float32)
    w = (1.0 + 2.0 ** -12 + rng.integers(0, 64, size=(16, 512)) * 2.0 ** -22).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    out = np.asarray(harness(DEVICE, "float32").linear(x, w, None, "float32"))
    assert rel(out, ref) < 1e-5
    assert rel(np.asarray(cpu.linear(x, w, None, "float32")), ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# attention (write_kv + paged attention)
# ---------------------------------------------------------------------------------------------
def make_attn_case(rng, q_lens, ctx_lens, page_size, kv_heads, head_dim, act, spare_pages=3):
    """A ragged batch over a shuffled page pool; returns the harness arguments (numpy)."""
    S = len(q_lens)
    pages_per = [(c + page_size - 1) // page_size for c in ctx_lens]
    max_pages = max(pages_per)
    total_pages = sum(pages_per) + spare_pages
    perm = rng.permutation(total_pages).astype(np.int32)
    page_table = np.zeros((S, max_pages), dtype=np.int32)
    q_start = np.zeros(S + 1, dtype=np.int32)
    kv_rows = []
    used = 0
    for s in range(S):
        page_table[s, : pages_per[s]] = perm[used : used + pages_per[s]]
        used += pages_per[s]
        q_start[s + 1] = q_start[s] + q_lens[s]
        for i in range(q_lens[s]):
            pos = ctx_lens[s] - q_lens[s] + i
            kv_rows.append(page_table[s, pos // page_size] * page_size + pos % page_size)
    T = int(q_start[-1])
    slots = total_pages * page_size
    kvc = kv_heads * head_dim
    k_cache = rand(rng, (slots, kvc), -1, 1, act)
    v_cache = rand(rng, (slots, kvc), -1, 1, act)
    k = rand(rng, (T, kvc), -1, 1, act)
    v = rand(rng, (T, kvc), -1, 1, act)
    return dict(
        k=k, v=v, k_cache=k_cache, v_cache=v_cache, q_start=q_start, ctx_len=np.asarray(ctx_lens, dtype=np.int32),
        page_table=page_table, kv_rows=np.asarray(kv_rows, dtype=np.int32), T=T,
    )


def run_attention(cpu, act, q_lens, ctx_lens, q_heads, kv_heads, head_dim, page_size, seed=0, qscale=2.0,
                  kv_dtype=""):
    rng = np.random.default_rng(seed)
    c = make_attn_case(rng, q_lens, ctx_lens, page_size, kv_heads, head_dim, act)
    q = rand(rng, (c["T"], q_heads * head_dim), -qscale, qscale, act)
    scale = 1.0 / math.sqrt(head_dim)
    args = (q, c["k"], c["v"], c["k_cache"], c["v_cache"], c["q_start"], c["ctx_len"], c["page_table"],
            c["kv_rows"], page_size, q_heads, kv_heads, head_dim, scale)
    ref, kref, vref = (np.asarray(a) for a in cpu.attention(*args, kv_dtype=kv_dtype))
    out, kout, vout = (np.asarray(a) for a in harness(DEVICE, act).attention(*args, kv_dtype=kv_dtype))
    assert np.array_equal(kout, kref) and np.array_equal(vout, vref), "write_kv differs"
    tol = 1e-5 if act == "float32" else TOL[act]
    err = rel(out, ref)
    assert err < tol, f"attention rel err {err:.3g}"
    return c, q, out


DECODE_CASES = [
    # q_lens, ctx_lens, q_heads, kv_heads, head_dim, page_size
    ([1], [1], 4, 4, 64, 16),
    ([1, 1, 1], [17, 100, 3000], 32, 8, 128, 16),  # Qwen3-8B heads, GQA 4
    ([1, 1], [33, 700], 8, 1, 128, 64),  # GQA 8
    ([1], [5000], 24, 4, 256, 16),  # Qwen3.8 attention, GQA 6
    ([1, 1, 1, 1], [1, 40, 700, 3001], 24, 4, 256, 8),  # the same over 8-key pages (a page lookup per key)
    ([1, 1, 1, 1], [1, 2, 15, 16], 16, 8, 64, 8),  # GQA 2, page edges
    ([1] * 17, list(range(3, 3 + 17 * 61, 61)), 16, 16, 128, 16),  # GQA 1, many sequences
    ([1, 1], [2048, 129], 64, 4, 128, 128),  # GQA 16: beyond the decode kernel's 8 heads, the rows kernel
    ([1, 1], [900, 64], 64, 2, 128, 16),  # GQA 32: the rows kernel
    # Batches large enough (on 132 SMs) for the decode kernel's 2 and 1 warps per (row, kv head), the last
    # block partly empty:
    ([1] * 270, [3 + (i * 37) % 250 for i in range(270)], 32, 2, 128, 16),
    ([1] * 529, [1 + (i * 53) % 300 for i in range(529)], 32, 2, 128, 16),
    ([1] * 300, [1 + (i * 29) % 200 for i in range(300)], 64, 8, 128, 32),  # GQA 8, 1 warp per pair
]

PREFILL_CASES = [
    ([37], [37], 8, 8, 64, 16),
    ([100], [100], 32, 8, 128, 16),
    ([257], [257], 12, 2, 64, 128),
    ([1000], [3000], 8, 8, 128, 16),  # chunked prefill over 2000 cached tokens
    ([129], [129], 24, 4, 256, 16),
    ([64, 3], [114, 3], 16, 4, 128, 64),
    ([700, 1500], [900, 4000], 32, 8, 128, 16),  # many key tiles, ragged, over cached tokens
    ([333], [333], 28, 4, 128, 16),  # GQA 7: rows per block not a multiple of the group
    ([600], [1100], 8, 8, 64, 32),  # GQA 1, head_dim 64
    ([700, 33], [1500, 33], 24, 4, 256, 16),  # head_dim 256: many key tiles over cached tokens, ragged
]

MIXED_CASES = [
    ([1, 50, 1, 7], [300, 80, 1, 7], 8, 2, 128, 16),
    ([129, 1], [1000, 2000], 24, 4, 256, 16),
    ([300, 20], [2048, 20], 32, 4, 128, 32),
    ([17, 1, 5], [17, 40, 60], 64, 8, 128, 16),
    ([3, 1, 2], [35, 17, 18], 4, 1, 64, 16),  # GQA 4, contexts spanning partial pages
]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"decode-{c[1]}-{c[2]}x{c[3]}-d{c[4]}-p{c[5]}")
def test_attention_decode(cpu, act, case):
    run_attention(cpu, act, *case, seed=len(case[0]) + case[4])




# The bf16/fp16 prefill kernel for head_dim 64/128: the mma.sync tile kernel, or on an sm_90 device with an
# sm_90a build the wgmma kernel, alone or with its warpgroups taking turns (elsewhere both run the tile kernel).
PREFILL_ATTN = ["mma", "wgmma", "pingpong"]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"prefill-{c[0]}-{c[1]}-{c[2]}x{c[3]}-d{c[4]}-p{c[5]}")
@pytest.mark.parametrize("kernel", PREFILL_ATTN)
def test_attention_prefill(cpu, act, case, kernel, monkeypatch):
    monkeypatch.setenv("QWEN_RT_PREFILL_ATTN", kernel)
    run_attention(cpu, act, *case, seed=case[0][0])


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", MIXED_CASES, ids=lambda c: f"mixed-{c[0]}-{c[1]}-{c[2]}x{c[3]}-d{c[4]}-p{c[5]}")
@pytest.mark.parametrize("kernel", PREFILL_ATTN)
def test_attention_mixed(cpu, act, case, kernel, monkeypatch):
    monkeypatch.setenv("QWEN_RT_PREFILL_ATTN", kernel)
    run_attention(cpu, act, *case, seed=sum(case[0]))


FP8_CACHE_CASES = DECODE_CASES[:6] + [DECODE_CASES[7]] + DECODE_CASES[9:11] + PREFILL_CASES[:6] + MIXED_CASES[:2] + \
    [MIXED_CASES[4]]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", FP8_CACHE_CASES, ids=lambda c: f"{c[0][:3]}-{c[1][:3]}-{c[2]}x{c[3]}-d{c[4]}-p{c[5]}")
@pytest.mark.parametrize("decode", ["rows", "default"])
def test_attention_fp8_cache(cpu, act, case, decode, monkeypatch):
    """An fp8 KV cache (decode: the decode kernel for 16-bit head_dim 128/256, else and with QWEN_RT_DECODE_ATTN=rows
    the rows kernel; prefill: the tile kernel converting as it stages): the rows write_kv quantizes equal the CPU's
    bit for bit (the same values in, the same rule), and the output is the CPU's."""
    monkeypatch.setenv("QWEN_RT_DECODE_ATTN", decode)
    run_attention(cpu, act, *case, seed=7 + case[4], kv_dtype="float8_e4m3")


QKV_ATTENTION_CASES = [
    # q_lens, ctx_lens, q_heads, kv_heads, head_dim, page_size, rot_dim, norm
    ([1], [1], 4, 4, 64, 16, 64, True),  # the new key alone
    ([1, 1, 1], [17, 100, 3000], 32, 8, 128, 16, 128, True),  # Qwen3-8B heads; splits at batch 3
    ([1, 1], [33, 700], 8, 1, 128, 64, 64, False),  # GQA 8, partial rotation, no q/k norm
    ([1, 1, 1, 1], [1, 2, 15, 16], 16, 8, 64, 8, 64, True),  # page edges
    ([1, 1], [2048, 129], 64, 4, 128, 128, 128, True),  # GQA 16: the composition
    ([1] * 270, [3 + (i * 37) % 250 for i in range(270)], 32, 2, 128, 16, 128, True),  # 2 warps per pair
    ([1] * 529, [1 + (i * 53) % 300 for i in range(529)], 32, 2, 128, 16, 128, True),  # 1 warp per pair
    ([1, 50, 1], [300, 80, 1], 8, 2, 128, 16, 128, True),  # not a decode batch: the composition
    ([1, 1], [900, 64], 64, 2, 128, 16, 128, True),  # GQA 32: the composition
]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", QKV_ATTENTION_CASES, ids=lambda c: f"{len(c[0])}x{c[1][:3]}-{c[2]}x{c[3]}-d{c[4]}-r{c[6]}")
def test_qkv_attention(cpu, act, case):
    """finish_qkv + attention from the q|k|v projection (the decode kernel does both for 16-bit decode
    batches) against the CPU's composition: the output and the k / v written to the cache."""
    check_qkv_attention(cpu, act, case, "")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", QKV_ATTENTION_CASES[:4] + QKV_ATTENTION_CASES[7:8],
                         ids=lambda c: f"{len(c[0])}x{c[1][:3]}-{c[2]}x{c[3]}-d{c[4]}-r{c[6]}")
def test_qkv_attention_fp8_cache(cpu, act, case):
    """The same into an fp8 cache (finish_qkv's fused kernel quantizes each head as it writes it): the CPU's cache
    and output within fp8's rounding (a value the two backends' RoPE puts on either side of a rounding boundary
    may take the neighbouring e4m3 value)."""
    check_qkv_attention(cpu, act, case, "float8_e4m3")


def check_qkv_attention(cpu, act, case, kv_dtype):
    q_lens, ctx_lens, hq, hkv, hd, page_size, rot_dim, norm = case
    rng = np.random.default_rng(len(q_lens) + hd + rot_dim)
    c = make_attn_case(rng, q_lens, ctx_lens, page_size, hkv, hd, act)
    qkv = rand(rng, (c["T"], (hq + 2 * hkv) * hd), -2, 2, act)
    pos = np.concatenate([np.arange(ctx - q, ctx) for q, ctx in zip(q_lens, ctx_lens)]).astype(np.int32)
    table = rope_table(4096, rot_dim)
    qw = rand(rng, (hd,), 0.5, 1.5) if norm else None
    kw = rand(rng, (hd,), 0.5, 1.5) if norm else None
    args = (qkv, c["k_cache"], c["v_cache"], c["q_start"], c["ctx_len"], c["page_table"], c["kv_rows"], page_size,
            pos, table, hq, hkv, hd, 1.0 / math.sqrt(hd), qw, kw, 1e-6)
    ref = [np.asarray(a) for a in cpu.qkv_attention(*args, kv_dtype=kv_dtype)]
    out = [np.asarray(a) for a in harness(DEVICE, act).qkv_attention(*args, kv_dtype=kv_dtype)]
    tol = 2e-2 if kv_dtype else 1e-5 if act == "float32" else TOL[act]
    for name, a, b in zip(("out", "k_cache", "v_cache"), out, ref):
        err = rel(a, b)
        assert err < tol, f"{name} rel err {err:.3g}"
    # The cache rows this step writes hold the new k / v (the rest unchanged).
    untouched = np.setdiff1d(np.arange(c["k_cache"].shape[0]), c["kv_rows"])
    assert np.array_equal(out[1][untouched], ref[1][untouched])
    if not kv_dtype:
        assert np.array_equal(out[1][untouched], np.asarray(c["k_cache"])[untouched])


def test_attention_is_causal_and_uses_the_cache(cpu):
    # Changing a cached key after a query's position must not change that query's output;
    # changing one before it must.
    act = "float32"
    rng = np.random.default_rng(3)
    q_lens, ctx = [8], [40]
    c = make_attn_case(rng, q_lens, ctx, 16, 2, 64, act)
    q = rand(rng, (8, 4 * 64), -2, 2, act)
    g = harness(DEVICE, act)
    base = (q, c["k"], c["v"], c["k_cache"], c["v_cache"], c["q_start"], c["ctx_len"], c["page_table"],
            c["kv_rows"], 16, 4, 2, 64, 0.125)
    out0 = np.asarray(g.attention(*base)[0])
    k2 = c["k"].copy()
    k2[7] += 1.0  # the last new token: seen only by the last query row
    out1 = np.asarray(g.attention(q, k2, *base[2:])[0])
    assert np.array_equal(out0[:7], out1[:7])
    assert not np.allclose(out0[7], out1[7])
    kc2 = c["k_cache"].copy()
    row = c["page_table"][0, 0] * 16 + 3  # cached position 3
    kc2[row] += 1.0
    out2 = np.asarray(g.attention(q, c["k"], c["v"], kc2, *base[4:])[0])
    assert np.all(np.abs(out2 - out0).max(axis=1) > 0)


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------
def row(**kw):
    r = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0, seed=0, draw=0, num_logprobs=0, seen_tokens=[], output_tokens=[],
             output_counts=[], banned_tokens=[])
    r.update(kw)
    return r


def log_softmax64(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("vocab", [151936, 248320])
def test_greedy_equals_argmax(cpu, vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0, 3, size=(64, vocab)).astype(np.float32)
    logits[5, 1000] = logits[5, 2000] = logits[5].max() + 1  # a tie: the lower id wins
    rows = [row(temperature=0.0, seed=i) for i in range(64)]
    res = harness(DEVICE, "float32").sample(logits, rows)
    tokens = np.asarray(res["tokens"])
    assert np.array_equal(tokens, np.argmax(logits, axis=1))
    assert tokens[5] == 1000
    lp = log_softmax64(logits)
    assert np.allclose(np.asarray(res["logprobs"]), lp[np.arange(64), tokens], atol=1e-4)


def sampling_rows(n, vocab, rng):
    rows = []
    for i in range(n):
        kind = i % 10
        seen = rng.choice(vocab, size=20, replace=False).astype(int).tolist()
        out = seen[:6]
        counts = rng.integers(1, 5, size=6).astype(int).tolist()
        base = dict(seed=int(1000 + i), draw=int(i * 3))
        rows.append([
            row(temperature=0.0, **base),
            row(temperature=1.0, **base),
            row(temperature=0.7, top_p=0.9, **base),
            row(temperature=1.3, top_k=5, **base),
            row(temperature=0.8, top_k=40, top_p=0.5, min_p=0.05, **base),
            row(temperature=0.0, repetition_penalty=1.3, seen_tokens=seen, banned_tokens=seen[10:13], **base),
            row(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, output_tokens=out,
                output_counts=counts, num_logprobs=5, **base),
            row(temperature=1.0, top_k=1, num_logprobs=3, **base),
            row(temperature=0.5, min_p=0.2, top_p=0.99, **base),
            row(temperature=1.1, repetition_penalty=0.8, seen_tokens=seen, top_p=0.7, num_logprobs=20, **base),
        ][kind])
    return rows


@pytest.mark.parametrize("vocab,n", [(10, 10), (1000, 30), (151936, 64)])
def test_sample_matches_cpu(cpu, vocab, n):
    rng = np.random.default_rng(vocab + n)
    logits = rng.normal(0, 2, size=(n, vocab)).astype(np.float32)
    rows = sampling_rows(n, vocab, rng) if vocab >= 20 else [
        row(temperature=[0.0, 1.0, 0.7][i % 3], top_p=[1.0, 0.9, 0.6][i % 3], seed=i, draw=i, num_logprobs=3)
        for i in range(n)
    ]
    a = cpu.sample(logits, rows)
    b = harness(DEVICE, "float32").sample(logits, rows)
    assert list(b["tokens"]) == list(a["tokens"])
    assert np.allclose(np.asarray(b["logprobs"]), np.asarray(a["logprobs"]), atol=1e-4)
    assert np.array_equal(np.asarray(b["top_ids"]), np.asarray(a["top_ids"]))
    ta, tb = np.asarray(a["top_logprobs"], dtype=np.float64), np.asarray(b["top_logprobs"], dtype=np.float64)
    assert np.array_equal(np.isinf(ta), np.isinf(tb))
    fin = np.isfinite(ta)
    assert np.allclose(tb[fin], ta[fin], atol=1e-4)


def test_sample_draw_paths_match_cpu(cpu):
    # The kernel draws a small top_k from a short candidate list (falling back to whole-row searches when
    # more than 1024 tokens tie at its bound), top_p alone by rejection, and anything else over the whole
    # row: each path against the CPU backend.
    rng = np.random.default_rng(21)
    vocab = 151936
    logits = rng.normal(0, 2, size=(24, vocab)).astype(np.float32)
    logits[3] = 0.0  # all tied: the candidate list overflows
    logits[4, : vocab // 2] = 1.0  # half tied at the top
    logits[5, 100:140] = logits[5].max() + 0.5  # 40 tied maxima
    seen = rng.choice(vocab, size=30, replace=False).astype(int).tolist()
    lists = dict(banned_tokens=seen[:3], repetition_penalty=1.3, seen_tokens=seen, presence_penalty=0.4,
                 output_tokens=seen[3:9], output_counts=[1, 2, 3, 1, 2, 3])
    cases = [dict(top_k=20), dict(top_k=20, top_p=0.95), dict(top_k=20, top_p=0.95, **lists), dict(top_k=20, top_p=0.9),
             dict(top_k=50, top_p=0.8), dict(top_k=30, top_p=0.5, min_p=0.1), dict(top_k=1024), dict(top_k=1025),
             dict(top_k=3000, top_p=0.9), dict(top_p=0.95), dict(top_p=0.3, min_p=0.05), dict(top_k=vocab, top_p=0.9),
             dict(top_k=2, temperature=0.3), dict(top_k=200, top_p=0.99), dict(top_p=0.999, **lists), dict(top_k=1000, top_p=0.7)]
    rows = [row(**{"temperature": 0.8, "seed": 7 + i, "draw": i, **cases[i % len(cases)]}) for i in range(24)]
    a = cpu.sample(logits, rows)
    b = harness(DEVICE, "float32").sample(logits, rows)
    assert list(b["tokens"]) == list(a["tokens"])
    assert np.allclose(np.asarray(b["logprobs"]), np.asarray(a["logprobs"]), atol=1e-4)


def test_sample_ties_bf16_logits(cpu):
    # bf16-valued logits have many exact ties, at the top_k and top_p cut points too.
    rng = np.random.default_rng(11)
    vocab, n = 5000, 40
    logits = round_to(rng.normal(0, 1.5, size=(n, vocab)).astype(np.float32), "bfloat16")
    logits = np.round(logits * 4) / 4  # coarser still: ties everywhere
    rows = [row(temperature=[0.9, 1.0, 0.6, 1.2][i % 4], top_k=[0, 50, 7, 0][i % 4], top_p=[0.8, 0.95, 1.0, 0.3][i % 4],
                seed=i, draw=2 * i) for i in range(n)]
    a = cpu.sample(logits.astype(np.float32), rows)
    b = harness(DEVICE, "float32").sample(logits.astype(np.float32), rows)
    assert list(b["tokens"]) == list(a["tokens"])


def test_top_k1_equals_greedy():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, size=(16, 151936)).astype(np.float32)
    g = harness(DEVICE, "float32")
    greedy = g.sample(logits, [row(temperature=0.0) for _ in range(16)])
    topk1 = g.sample(logits, [row(temperature=0.8, top_k=1, seed=i, draw=i) for i in range(16)])
    assert list(topk1["tokens"]) == list(greedy["tokens"])


def test_sample_depends_only_on_seed_and_draw():
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 1, size=(8, 1000)).astype(np.float32)
    g = harness(DEVICE, "float32")
    rows = [row(temperature=1.0, seed=42, draw=7) for _ in range(8)]
    same = np.repeat(logits[:1], 8, axis=0)
    toks = list(g.sample(same, rows)["tokens"])
    assert len(set(toks)) == 1  # the same (seed, draw, logits) gives the same token in every row
    alone = list(g.sample(same[:1], rows[:1])["tokens"])
    assert alone[0] == toks[0]
    # different draws give a spread of tokens on a flat distribution
    flat = np.zeros((64, 1000), dtype=np.float32)
    spread = g.sample(flat, [row(temperature=1.0, seed=42, draw=d) for d in range(64)])["tokens"]
    assert len(set(spread)) > 40


def test_banned_and_penalties(cpu):
    vocab = 151936
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, size=(4, vocab)).astype(np.float32)
    top = int(np.argmax(logits[0]))
    rows = [
        row(temperature=0.0, banned_tokens=[top]),
        row(temperature=0.0, repetition_penalty=10.0, seen_tokens=[int(np.argmax(logits[1]))]),
        row(temperature=0.0, presence_penalty=100.0, output_tokens=[int(np.argmax(logits[2]))], output_counts=[1]),
        row(temperature=0.0, frequency_penalty=-100.0, output_tokens=[17], output_counts=[2]),
    ]
    b = harness(DEVICE, "float32").sample(logits, rows)
    a = cpu.sample(logits, rows)
    assert list(b["tokens"]) == list(a["tokens"])
    toks = list(b["tokens"])
    assert toks[0] != top and toks[1] != int(np.argmax(logits[1])) and toks[2] != int(np.argmax(logits[2]))
    assert toks[3] == 17


def test_linear_many_shapes_past_the_plan_cache():
    """More distinct token counts than cuBLASLt plans are kept (1024): the cache starts over and every shape
    still gives the right product, the first time and after the plans that made it were dropped."""
    rng = np.random.default_rng(5)
    n, k = 24, 40
    w = rand(rng, (n, k)) / math.sqrt(k)
    x = rand(rng, (1200, k))
    h = harness(DEVICE, "float32")
    for _ in range(2):
        for m in range(9, 1200):
            out = np.asarray(h.linear(x[:m], w, None, "float32"))
            assert rel(out, x[:m].astype(np.float64) @ w.T.astype(np.float64)) < TOL["float32"], m


# ---------------------------------------------------------------------------------------------
# gated attention and Gated DeltaNet (sigmoid_mul, gated_rms_norm, causal_conv1d, gated_delta_rule)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 17), (257, 1000), (17, 6144)])
def test_sigmoid_mul(cpu, act, rows, cols):
    rng = np.random.default_rng(rows + cols)
    x = rand(rng, (rows, cols), -3, 3, act)
    gate = rand(rng, (rows, cols), -6, 6, act)
    ref = np.asarray(cpu.sigmoid_mul(x, gate))
    out = np.asarray(harness(DEVICE, act).sigmoid_mul(x, gate))
    assert rel(ref, x.astype(np.float64) / (1.0 + np.exp(-gate.astype(np.float64)))) < 1e-6
    assert rel(out, ref) < TOL[act]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows", [1, 3, 17, 257])
@pytest.mark.parametrize("heads,head_dim", [(1, 64), (48, 128), (3, 100), (5, 7)])
def test_gated_rms_norm(cpu, act, rows, heads, head_dim):
    rng = np.random.default_rng(rows * 100 + heads + head_dim)
    x = rand(rng, (rows, heads * head_dim), -3, 3, act)
    z = rand(rng, (rows, heads * head_dim), -4, 4, act)
    w = rand(rng, (1, head_dim), 0.5, 1.5)
    ref = np.asarray(cpu.gated_rms_norm(x, z, w, 1e-6, head_dim))
    out = np.asarray(harness(DEVICE, act).gated_rms_norm(x, z, w, 1e-6, head_dim))
    assert rel(out, ref) < TOL[act]
    # per head: rmsnorm(x) * w (plain gain) * silu(z)
    xr = x.reshape(rows, heads, head_dim).astype(np.float64)
    zr = z.reshape(rows, heads, head_dim).astype(np.float64)
    manual = xr / np.sqrt((xr * xr).mean(-1, keepdims=True) + 1e-6) * w[0] * zr / (1.0 + np.exp(-zr))
    assert rel(ref, manual.reshape(rows, -1)) < 1e-5


def state_batch(rng, q_lens, starts, spare=2):
    """Sequences of q_lens tokens at positions starts (0: a fresh state) on shuffled slots among
    len(q_lens) + spare; returns (q_start, ctx_len, slots, num_slots)."""
    S = len(q_lens)
    slots = rng.permutation(S + spare)[:S].astype(np.int32)
    q_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ctx_len = (np.asarray(starts) + np.asarray(q_lens)).astype(np.int32)
    return q_start, ctx_len, slots, S + spare


def poison_fresh_slots(state, slots, starts):
    """NaN in the slots of sequences that start at position 0: the ops must not read them."""
    for slot, start in zip(slots, starts):
        if start == 0:
            state[slot] = np.nan


def conv_channels(k_heads, v_heads, k_dim, v_dim):
    return 2 * k_heads * k_dim + v_heads * v_dim


CONV_SHAPES = [  # k_heads, v_heads, k_dim, v_dim, conv kernel
    (16, 48, 128, 128, 4),  # Qwen3.8-27B on one rank: 10240 channels
    (1, 3, 5, 7, 4),  # 31 channels: a partial block
    (2, 4, 32, 64, 4),
    (1, 2, 3, 5, 3),
    (2, 2, 4, 9, 2),
]
STATE_BATCHES = [  # q_lens, start positions (0: from a zero state)
    ([1], [0]),
    ([1, 1, 1], [5, 0, 1]),  # decode
    ([2], [9]),  # fewer new tokens than the conv history: the new history keeps part of the old
    ([1, 2, 5, 64, 130, 1], [7, 0, 0, 3, 0, 2]),  # mixed; prefill token groups
    ([2, 40, 3], [9, 0, 0]),  # short sequences among token groups (some groups empty)
    ([300, 1], [1000, 4]),  # a long chunk continuing
]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("batch", STATE_BATCHES, ids=lambda b: f"{b[0]}-{b[1]}")
def test_causal_conv1d(cpu, act, shape, batch):
    hk, hv, dk, dv, kernel = shape
    q_lens, starts = batch
    rng = np.random.default_rng(sum(shape) + sum(q_lens))
    q_start, ctx_len, slots, num_slots = state_batch(rng, q_lens, starts)
    C = conv_channels(hk, hv, dk, dv)
    T = int(q_start[-1])
    x = rand(rng, (T, C), -2, 2, act)
    w = rand(rng, (C, kernel), -1, 1, act)
    conv_state = rand(rng, (num_slots, (kernel - 1) * C), -2, 2, act)
    poison_fresh_slots(conv_state, slots, starts)
    args = (x, w, conv_state, q_start, ctx_len, slots, hk, hv, dk, dv, kernel)
    ref, ref_state = (np.asarray(a) for a in cpu.causal_conv1d(*args))
    out, out_state = (np.asarray(a) for a in harness(DEVICE, act).causal_conv1d(*args))
    assert np.all(np.isfinite(ref)) and np.all(np.isfinite(ref_state))
    for s in range(len(q_lens)):  # each sequence on its own: a short one is not lost in a long one's norm
        rows = slice(q_start[s], q_start[s + 1])
        err = rel(out[rows], ref[rows])
        assert err < (1e-5 if act == "float32" else TOL[act]), f"sequence {s}: rel err {err:.3g}"
    # The new history is made of inputs (or zeros): exact, and the slots outside the batch are untouched.
    assert np.array_equal(out_state, ref_state)
    # The history is the last kernel - 1 inputs of each sequence's window.
    for s, slot in enumerate(slots):
        hist = ref_state[slot].reshape(kernel - 1, C)
        old = np.zeros((kernel - 1, C), np.float32) if starts[s] == 0 else conv_state[slot].reshape(kernel - 1, C)
        window = np.concatenate([old, x[q_start[s]:q_start[s + 1]]])
        assert np.array_equal(hist, window[-(kernel - 1):])


GDN_SHAPES = [  # k_heads, v_heads, k_dim, v_dim
    (16, 48, 128, 128),  # Qwen3.8-27B on one rank: value heads / key heads 3
    (2, 4, 64, 64),  # ratio 2
    (3, 3, 32, 32),  # ratio 1
    (1, 3, 32, 48),  # v_dim not a multiple of a block's 32 columns
    (2, 2, 16, 24),
    (4, 8, 128, 64),
]


def gdn_inputs(rng, T, hk, hv, dk, dv, num_slots, act):
    """qkv as the conv's SiLU gives it, a / b projections, and decays of a few tokens to many."""
    qkv = rand(rng, (T, 2 * hk * dk + hv * dv), -0.3, 1.5, act)
    a = rand(rng, (T, hv), -2, 2, act)
    b = rand(rng, (T, hv), -3, 3, act)
    a_log = rand(rng, (hv,), -3.0, 0.5)
    dt_bias = rand(rng, (hv,), -2.0, 0.0)
    state = rand(rng, (num_slots, hv * dk * dv), -0.5, 0.5)
    return qkv, a, b, a_log, dt_bias, state


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("batch", STATE_BATCHES, ids=lambda b: f"{b[0]}-{b[1]}")
@pytest.mark.parametrize("form", ["loop", "chunks"])
def test_gated_delta_rule(cpu, act, shape, batch, form, monkeypatch):
    monkeypatch.setenv("QWEN_RT_DELTA_RULE", form)
    hk, hv, dk, dv = shape
    q_lens, starts = batch
    rng = np.random.default_rng(sum(shape) + sum(q_lens))
    q_start, ctx_len, slots, num_slots = state_batch(rng, q_lens, starts)
    T = int(q_start[-1])
    qkv, a, b, a_log, dt_bias, state = gdn_inputs(rng, T, hk, hv, dk, dv, num_slots, act)
    untouched = np.setdiff1d(np.arange(num_slots), slots)
    poison_fresh_slots(state, slots, starts)
    args = (qkv, a, b, a_log, dt_bias, state, q_start, ctx_len, slots, hk, hv, dk, dv)
    ref, ref_state = (np.asarray(x) for x in cpu.gated_delta_rule(*args))
    out, out_state = (np.asarray(x) for x in harness(DEVICE, act).gated_delta_rule(*args))
    assert np.all(np.isfinite(ref)) and np.all(np.isfinite(ref_state[slots]))
    for s, slot in enumerate(slots):
        out_tol, state_tol = delta_rule_tolerances(act, dk, dv, q_lens[s], form)
        rows = slice(q_start[s], q_start[s + 1])
        err = rel(out[rows], ref[rows])
        assert err < out_tol, f"sequence {s} (q_len {q_lens[s]}): output rel err {err:.3g}"
        err = rel(out_state[slot], ref_state[slot])
        assert err < state_tol, f"sequence {s} (q_len {q_lens[s]}): state rel err {err:.3g}"
    assert np.array_equal(out_state[untouched], state[untouched])


def takes_chunks(act, dk, dv, q_len, form):
    """Whether the CUDA delta rule runs a sequence in chunks of 64 on tensor cores (gdn.cu's plan_delta_rule; form:
    QWEN_RT_DELTA_RULE, "loop" or the default "chunks")."""
    return form == "chunks" and act != "float32" and dk in (64, 128) and dv % 32 == 0 and dv <= 128 and q_len >= 64


def delta_rule_tolerances(act, dk, dv, q_len, form):
    """(output, state) relative tolerances against the CPU's fp32 token loop. The token loop: the output is rounded
    to the activation dtype; the state is fp32 on both sides, from the same (rounded) inputs, and differs only by
    the order of fp32 sums over up to 300 steps. The chunked form multiplies 16-bit operands (the state and the
    deltas rounded to the activation dtype; host emulation against fp64, 150 rows: 3.5e-3 bf16, 5e-4 f16)."""
    if takes_chunks(act, dk, dv, q_len, form):
        return {"bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3)}[act]
    return {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}[act], 1e-4


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_chunked_delta_rule_against_the_token_loop(cpu, act, monkeypatch):
    """The chunked form (the default) against the token loop on Qwen3.8-27B's head sizes: close, and
    with windows of one chunk slot (QWEN_RT_DELTA_RULE_WINDOW=1) the same bits as in one window; a short sequence
    among chunked ones gets the token loop's bits."""
    hk, hv, dk, dv = 2, 6, 128, 128
    q_lens, starts = [200, 5, 64, 129], [0, 3, 40, 0]
    rng = np.random.default_rng(41)
    q_start, ctx_len, slots, num_slots = state_batch(rng, q_lens, starts)
    qkv, a, b, a_log, dt_bias, state = gdn_inputs(rng, int(q_start[-1]), hk, hv, dk, dv, num_slots, act)
    args = (qkv, a, b, a_log, dt_bias, state, q_start, ctx_len, slots, hk, hv, dk, dv)
    g = harness(DEVICE, act)

    def run(**env):
        for k in ("QWEN_RT_DELTA_RULE", "QWEN_RT_DELTA_RULE_WINDOW"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        return tuple(np.asarray(x) for x in g.gated_delta_rule(*args))

    out, st = run()
    out_w, st_w = run(QWEN_RT_DELTA_RULE_WINDOW="1")
    out_l, st_l = run(QWEN_RT_DELTA_RULE="loop")
    assert np.array_equal(out, out_w) and np.array_equal(st, st_w)
    short = slice(q_start[1], q_start[2])
    assert np.array_equal(out[short], out_l[short]) and np.array_equal(st[slots[1]], st_l[slots[1]])
    for s in (0, 2, 3):
        rows = slice(q_start[s], q_start[s + 1])
        out_tol, state_tol = delta_rule_tolerances(act, dk, dv, q_lens[s], "chunks")
        assert rel(out[rows], out_l[rows]) < out_tol, s
        assert rel(st[slots[s]], st_l[slots[s]]) < state_tol, s
        assert not np.array_equal(out[rows], out_l[rows]), s  # the chunked form ran


@pytest.mark.parametrize("act", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["loop", "chunks"])
def test_delta_net_ops_do_not_depend_on_the_batch(act, form, monkeypatch):
    """A sequence's conv and delta-rule outputs and new states are bitwise the same alone and among batch mates
    (decode and prefill, before and after it, on other slots; alone it is short enough for the conv's one token
    group per block, among them it is split into groups), with the delta rule in either form."""
    monkeypatch.setenv("QWEN_RT_DELTA_RULE", form)
    hk, hv, dk, dv, kernel = 2, 6, 128, 128, 4
    C = conv_channels(hk, hv, dk, dv)
    rng = np.random.default_rng(23)
    q_lens, starts, slots = [1, 64, 20, 5], [10, 0, 50, 3], np.asarray([0, 1, 3, 2], np.int32)
    q_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ctx_len = (np.asarray(starts) + np.asarray(q_lens)).astype(np.int32)
    T = int(q_start[-1])
    rows = slice(q_start[2], q_start[3])  # sequence 2, on slot 3
    alone = (np.asarray([0, 20], np.int32), np.asarray([70], np.int32), np.asarray([3], np.int32))
    g = harness(DEVICE, act)

    x = rand(rng, (T, C), -2, 2, act)
    w = rand(rng, (C, kernel), -1, 1, act)
    conv_state = rand(rng, (4, (kernel - 1) * C), -2, 2, act)
    out_b, st_b = (np.asarray(a) for a in g.causal_conv1d(x, w, conv_state, q_start, ctx_len, slots, hk, hv, dk, dv,
                                                          kernel))
    out_a, st_a = (np.asarray(a) for a in g.causal_conv1d(x[rows], w, conv_state, *alone, hk, hv, dk, dv, kernel))
    assert np.array_equal(out_b[rows], out_a)
    assert np.array_equal(st_b[3], st_a[3])

    qkv, a, b, a_log, dt_bias, state = gdn_inputs(rng, T, hk, hv, dk, dv, 4, act)
    out_b, st_b = (np.asarray(o) for o in g.gated_delta_rule(qkv, a, b, a_log, dt_bias, state, q_start, ctx_len, slots,
                                                             hk, hv, dk, dv))
    out_a, st_a = (np.asarray(o) for o in g.gated_delta_rule(qkv[rows], a[rows], b[rows], a_log, dt_bias, state,
                                                             *alone, hk, hv, dk, dv))
    assert np.array_equal(out_b[rows], out_a)
    assert np.array_equal(st_b[3], st_a[3])
    # Sequence 1 (64 rows: in chunks where 16-bit) alone.
    rows = slice(q_start[1], q_start[2])
    alone = (np.asarray([0, 64], np.int32), np.asarray([64], np.int32), np.asarray([1], np.int32))
    out_a, st_a = (np.asarray(o) for o in g.gated_delta_rule(qkv[rows], a[rows], b[rows], a_log, dt_bias, state,
                                                             *alone, hk, hv, dk, dv))
    assert np.array_equal(out_b[rows], out_a)
    assert np.array_equal(st_b[1], st_a[1])


# ---------------------------------------------------------------------------------------------
# FP8 weights (W8A16): the CUDA FP8 linear against the CPU's on the same e4m3 values and block scales
# ---------------------------------------------------------------------------------------------
def fp8_weights(cpu, rng, n, k, shift):
    """e4m3 values (as float32, from the CPU's block quantization of random values) and random scales
    [ceil(n / 2^shift), ceil(k / 128)] around 1 / sqrt(k) (so outputs stay of order one)."""
    q, _ = cpu.quantize_fp8(rng.standard_normal((n, k)).astype(np.float32), "float32")
    s = (rng.uniform(0.5, 1.5, (-(-n // (1 << shift)), -(-k // 128))) / (448 * math.sqrt(k))).astype(np.float32)
    return np.asarray(q), s


# (m, n, k, row shift): decode rows, odd N, K not a multiple of 16 (the GEMV declines: the GEMM path), K not a
# multiple of 128 (the CUDA-core GEMV), fused-part shifts, the tensor-core GEMV's 9-32 rows, prefill rows.
FP8_SHAPES = [(1, 16, 128, 7), (1, 4096, 1024, 7), (2, 100, 512, 5), (8, 1024, 4096, 7), (5, 96, 160, 3),
              (3, 1000, 333, 7), (12, 300, 640, 3), (16, 512, 1024, 7), (32, 200, 1280, 0), (64, 256, 1024, 0),
              (257, 64, 1024, 7)]


def fp8_gemv_takes(act, m, k):
    """Whether the FP8 GEMV takes m rows (QWEN_RT_GEMV_ROWS=32): its tensor-core form up to 32 (16-bit x, K a
    multiple of 128), its CUDA-core form up to 8 (K a multiple of 16)."""
    return m <= 32 if act != "float32" and k % 128 == 0 else m <= 8 and k % 16 == 0


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,n,k,shift", FP8_SHAPES)
@pytest.mark.parametrize("gemv_rows", ["0", "32"])  # every row through the dequantizing GEMM; the GEMV where it can
def test_fp8_linear(cpu, act, m, n, k, shift, gemv_rows, monkeypatch):
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    monkeypatch.setenv("QWEN_RT_FP8_GEMM", "dequant")  # the weight-only product (W8A8: test_fp8_w8a8_gemm)
    rng = np.random.default_rng(m * 131 + n * 7 + k + shift)
    q, s = fp8_weights(cpu, rng, n, k, shift)
    x = rand(rng, (m, k), -1, 1, act)
    b = rand(rng, (1, n), -1, 1, act)
    res = rand(rng, (m, n), -1, 1, act)
    h = harness(DEVICE, act)
    for op, kw in (("linear", dict(bias=b)), ("linear", dict(bias=b, f32_out=True)), ("linear_add", dict(res=res))):
        ref = np.asarray(cpu.fp8_linear(op, x, q, s, shift, **kw))
        out = np.asarray(h.fp8_linear(op, x, q, s, shift, **kw))
        assert out.shape == ref.shape and rel(out, ref) < TOL[act], (op, kw.keys())
    if gemv_rows != "0" and fp8_gemv_takes(act, m, k):  # batch invariance: each row alone gives the same bits
        out = np.asarray(h.fp8_linear("linear", x, q, s, shift))
        # (The tensor-core form runs from 2 rows by default, the CUDA-core form at 1: one row through the former.)
        monkeypatch.setenv("QWEN_RT_FP8_GEMV_MMA_FROM", "1" if m > 1 else "2")
        for r in sorted({0, m // 2, m - 1}):
            np.testing.assert_array_equal(np.asarray(h.fp8_linear("linear", x[r:r + 1], q, s, shift)), out[r:r + 1])


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k,shift", [(1, 5000, 640, 7), (5, 4100, 1024, 3), (17, 3000, 384, 7), (32, 2900, 1280, 0)])
def test_fp8_gemv_persistent_grid_gives_the_same_bits(cpu, act, m, n, k, shift, monkeypatch):
    """The tensor-core FP8 GEMV with a persistent grid (QWEN_RT_FP8_GEMV_BLOCKS: each block walks several 16-row
    tiles, its warps' copy rings running on from one tile into the next) gives the bits of one block per tile, plain,
    with bias, accumulated and gated."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", "32")
    monkeypatch.setenv("QWEN_RT_FP8_GEMV_MMA_FROM", "1")
    rng = np.random.default_rng(m + n + k)
    q, s = fp8_weights(cpu, rng, n, k, shift)
    x = rand(rng, (m, k), -1, 1, act)
    b = rand(rng, (1, n), -1, 1, act)
    res = rand(rng, (m, n), -1, 1, act)
    h = harness(DEVICE, act)
    runs = {}
    for blocks in ("0", "1", "2"):
        monkeypatch.setenv("QWEN_RT_FP8_GEMV_BLOCKS", blocks)
        runs[blocks] = [np.asarray(h.fp8_linear("linear", x, q, s, shift, bias=b)),
                        np.asarray(h.fp8_linear("linear_add", x, q, s, shift, res=res)),
                        np.asarray(h.fp8_linear("linear_silu_mul", x, q[: n // 2 * 2], s, shift))]
    assert rel(runs["0"][0], np.asarray(cpu.fp8_linear("linear", x, q, s, shift, bias=b))) < TOL[act]
    for blocks in ("1", "2"):
        for got, want in zip(runs[blocks], runs["0"]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("n,k", [(5000, 640), (300, 336), (1001, 4096)])
def test_fp8_gemv_one_piece_in_flight_gives_the_same_bits(cpu, act, n, k, monkeypatch):
    """The CUDA-core FP8 GEMV at 1 row with one piece in flight per lane (QWEN_RT_FP8_GEMV_INFLIGHT=1) gives the
    bits of four: plain, with bias, accumulated and gated."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", "32")
    rng = np.random.default_rng(n + k)
    q, s = fp8_weights(cpu, rng, n, k, 7)
    x = rand(rng, (1, k), -1, 1, act)
    b = rand(rng, (1, n), -1, 1, act)
    res = rand(rng, (1, n), -1, 1, act)
    h = harness(DEVICE, act)
    runs = {}
    for inflight in ("4", "1"):
        monkeypatch.setenv("QWEN_RT_FP8_GEMV_INFLIGHT", inflight)
        runs[inflight] = [np.asarray(h.fp8_linear("linear", x, q, s, 7, bias=b)),
                          np.asarray(h.fp8_linear("linear_add", x, q, s, 7, res=res)),
                          np.asarray(h.fp8_linear("linear_silu_mul", x, q[: n // 2 * 2], s, 7))]
    assert rel(runs["1"][0], np.asarray(cpu.fp8_linear("linear", x, q, s, 7, bias=b))) < TOL[act]
    for got, want in zip(runs["1"], runs["4"]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_fp8_gemv_converts_every_e4m3_code(cpu, act, monkeypatch):
    """The tensor-core GEMV converts every finite e4m3 code exactly (zero, subnormal, normal, both signs): x rows
    of one-hot columns make each fp32 output one weight times its block scale, the CPU's product bit for bit."""
    import torch
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", "32")
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    codes = codes[np.isfinite(codes)]
    assert codes.size == 254
    n, k, m = 256, 512, 32
    q = codes[np.arange(n * k) % codes.size].reshape(n, k).astype(np.float32)
    s = np.random.default_rng(5).uniform(0.5, 2.0, (n // 128, k // 128)).astype(np.float32)
    cols = np.arange(m) * 15  # each row's one column: 32 columns x 256 rows cover every code
    x = np.zeros((m, k), np.float32)
    x[np.arange(m), cols] = 1.0
    out = np.asarray(harness(DEVICE, act).fp8_linear("linear", x, q, s, 7, f32_out=True))
    want = (q[:, cols] * s[:, cols // 128].repeat(128, 0)).T  # fp32 products, as the CPU dequantizes
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out, np.asarray(cpu.fp8_linear("linear", x, q, s, 7, f32_out=True)))


def quantize_rows_e4m3(x: np.ndarray) -> np.ndarray:
    """The W8A8 GEMM's activations as their dequantized values: per row and 128 columns s = amax / 448 (1 for zeros),
    e4m3(x / s) * s (torch's float8_e4m3fn rounding: nearest even, saturated)."""
    import torch
    m, k = x.shape
    g = x.reshape(m, k // 128, 128).astype(np.float32)
    amax = np.abs(g).max(-1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    q = torch.from_numpy(np.clip(g / s, -448, 448)).to(torch.float8_e4m3fn).float().numpy()
    return (q.astype(np.float64) * s).reshape(m, k)


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
@pytest.mark.parametrize("m,n,k", [(9, 256, 1024), (64, 1024, 4096), (200, 384, 512), (300, 640, 1280)])
def test_fp8_w8a8_gemm(cpu, act, m, n, k, monkeypatch):
    """FP8 linears of 16-bit activations on Hopper (from 5 rows; here every row count, the GEMV off): the activations
    quantized per row and 128 columns, one block-scaled FP8 GEMM (CUTLASS's); against numpy on the same quantized
    values (and further from the weight-only product it replaces, which QWEN_RT_FP8_GEMM=dequant gives)."""
    monkeypatch.delenv("QWEN_RT_FP8_GEMM", raising=False)
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", "0")
    rng = np.random.default_rng(m + n + k)
    q, s = fp8_weights(cpu, rng, n, k, 7)
    w = q.astype(np.float64) * np.repeat(np.repeat(s, 128, 0)[:n], 128, 1)[:, :k]
    x = rand(rng, (m, k), -1, 1, act)
    out = np.asarray(harness(DEVICE, act).fp8_linear("linear", x, q, s, 7))
    w8a8 = quantize_rows_e4m3(x) @ w.T
    w8a16 = x.astype(np.float64) @ w.T
    assert rel(out, w8a8) < 8e-3, rel(out, w8a8)
    assert rel(out, w8a16) > 2 * rel(out, w8a8)  # the W8A8 path ran
    monkeypatch.setenv("QWEN_RT_FP8_GEMM", "dequant")
    dq = np.asarray(harness(DEVICE, act).fp8_linear("linear", x, q, s, 7))
    assert rel(dq, w8a16) < 8e-3 and rel(dq, w8a8) > 2 * rel(dq, w8a16)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m,inter,k,shift", [(1, 64, 1024, 7), (4, 100, 512, 2), (8, 1536, 1024, 7), (13, 200, 768, 7),
                                             (32, 40, 384, 4), (33, 24, 256, 3)])
@pytest.mark.parametrize("gemv_rows", ["0", "32"])
def test_fp8_linear_silu_mul_and_norm(cpu, act, m, inter, k, shift, gemv_rows, monkeypatch):
    """gate|up with silu_mul (the GEMV fuses it: equal to linear then silu_mul bit for bit), and norm_linear with
    a gain (FP8 linears never get folded gains: rms_norm, then the FP8 linear), against the CPU (weight-only)."""
    monkeypatch.setenv("QWEN_RT_GEMV_ROWS", gemv_rows)
    monkeypatch.setenv("QWEN_RT_FP8_GEMM", "dequant")
    rng = np.random.default_rng(m * 17 + inter + k)
    q, s = fp8_weights(cpu, rng, 2 * inter, k, shift)
    x = rand(rng, (m, k), -1, 1, act)
    g = rand(rng, (k,), 0.5, 1.5)
    h = harness(DEVICE, act)
    out = np.asarray(h.fp8_linear("linear_silu_mul", x, q, s, shift))
    np.testing.assert_array_equal(out, np.asarray(h.silu_mul(np.asarray(h.fp8_linear("linear", x, q, s, shift)))))
    assert rel(out, np.asarray(cpu.fp8_linear("linear_silu_mul", x, q, s, shift))) < TOL[act]
    for op in ("norm_linear", "norm_linear_silu_mul"):
        ref = np.asarray(cpu.fp8_linear(op, x, q, s, shift, norm_w=g))
        assert rel(np.asarray(h.fp8_linear(op, x, q, s, shift, norm_w=g)), ref) < TOL[act], op


@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,cols", [(300, 260), (128, 128), (1, 5), (1000, 4096)])
def test_fp8_quantize_equals_cpu(cpu, src_dtype, rows, cols):
    """Backend::quantize_fp8 on the GPU: the CPU's e4m3 values and scales bit for bit (a zero block too)."""
    rng = np.random.default_rng(rows + cols)
    src = (rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, 1)))).astype(np.float32)
    src[:64, :64] = 0
    act = "float32" if src_dtype == "float32" else "bfloat16"
    q, s = harness(DEVICE, act).quantize_fp8(src, src_dtype)
    rq, rs = cpu.quantize_fp8(src, src_dtype)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
    np.testing.assert_array_equal(np.asarray(q), np.asarray(rq))
