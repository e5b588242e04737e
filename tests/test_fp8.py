"""FP8 weights on the CPU: Qwen's block-128 FP8 checkpoints and compressed-tensors FP8 (per-channel) against
transformers on the dequantized weights in fp32, dense and hybrid; quantization="fp8" at load equal to the block
quantization of the originals; tensor parallelism; bad scales and mismatched checkpoints refused; the CPU FP8
linear against a plain dequantized reference."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import models as M
import qwen_rt
from qwen_rt import _core

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def fp8(build, tmp_path_factory):
    """fp8(name, fmt="qwen", scale_dtype=torch.bfloat16, layout="plain") -> (FP8 folder, dequantized fp32 reference
    folder), built once. layout "multimodal": Qwen's multimodal layout with modules_to_not_convert named without
    model.language_model.; "prefixed": the plain layout with names under model.language_model."""
    cache, lock = {}, threading.Lock()

    def _make(name, fmt="qwen", scale_dtype=torch.bfloat16, layout="plain"):
        key = (name, fmt, str(scale_dtype), layout)
        with lock:
            if key not in cache:
                d = tmp_path_factory.mktemp(f"{name}_fp8")
                prefix = {"plain": None, "multimodal": "model.layers.", "prefixed": "model.language_model.layers."}[layout]
                out = M.to_fp8(build(name), d / "fp8", d / "ref", fmt=fmt, scale_dtype=scale_dtype,
                               not_converted_prefix=prefix)
                if layout == "multimodal":
                    M.to_multimodal_layout(out)

                    def lift(c):  # Qwen's configs keep quantization_config at the top level
                        c["quantization_config"] = c["text_config"].pop("quantization_config")
                    M.edit_json(out / "config.json", lift)
                cache[key] = (out, d / "ref")
            return cache[key]

    return _make


def greedy_and_logprobs(gen, prompts, n):
    outs = gen.generate(prompts, max_tokens=n, logprobs=2, **GREEDY)
    return [o.token_ids for o in outs], [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]


def check_against_reference(gen, ref, n=10, seed=5, lengths=(3, 30)):
    """Greedy tokens equal transformers' on the dequantized weights (fp32); logprobs within fp32 rounding."""
    prompts = M.pick_prompts(ref, seed=seed, lengths=list(lengths), max_new=n)
    toks, lps = greedy_and_logprobs(gen, prompts, n)
    for p, t, lp in zip(prompts, toks, lps):
        msg = M.greedy_mismatch(ref, p, t, n)
        assert not msg, msg
        ref_lp = [float(r[k]) for r, k in zip(M.hf_greedy_logprobs(ref, p, n), t)]
        np.testing.assert_allclose(lp, ref_lp, atol=2e-4, rtol=0)
    return prompts, toks, lps


# --- checkpoints against transformers ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,fmt,scale_dtype,layout", [
    ("qwen3_gqa2_tied", "qwen", torch.bfloat16, "plain"),       # head_dim 24: q rows 96, fused q|k|v blocks of 32
    ("qwen3_mha_untied", "qwen", torch.float32, "prefixed"),
    ("qwen2_gqa4_untied", "channel", torch.float32, "plain"),   # compressed-tensors, per-row scales; q/k/v biases
    ("qwen35_hybrid", "qwen", torch.bfloat16, "multimodal"),    # in_proj_a/b bf16: b|a its own linear
    ("qwen35_mixed_tied", "channel", torch.bfloat16, "plain"),
    ("qwen35_fp8_tp", "qwen", torch.float32, "prefixed"),
])
def test_fp8_checkpoint_matches_transformers(fp8, make_gen, name, fmt, scale_dtype, layout):
    folder, ref = fp8(name, fmt, scale_dtype, layout)
    gen = make_gen(folder)
    assert gen.quantization == "fp8"
    check_against_reference(gen, ref)


def test_fp8_weights_are_one_byte(fp8, build, make_gen):
    """The FP8 model holds its projections at a byte per weight plus the scales (footprint = what it allocates)."""
    folder, _ = fp8("qwen35_hybrid", layout="multimodal")
    gen = make_gen(folder)
    plain = make_gen(build("qwen35_hybrid"))
    assert gen.stats()["weight_bytes"] < 0.6 * plain.stats()["weight_bytes"]


@pytest.mark.parametrize("name,layout,kw", [
    ("qwen35_hybrid", "multimodal", {}),
    ("qwen3_gqa2_tied", "plain", {"dtype": "bfloat16"}),
    ("qwen35_fp8_tp", "prefixed", {"tensor_parallel_size": 2}),
    ("qwen3_fp8_tp", "plain", {"tensor_parallel_size": 2}),
])
def test_footprint_counts_fp8_weights(fp8, make_gen, name, layout, kw):
    """model/footprint.cpp's weights are exactly the bytes the FP8 model holds (scale grids included)."""
    from qwen_rt.config import native_config
    from qwen_rt.model_files import text_config
    folder, _ = fp8(name, layout=layout)
    g = make_gen(folder, **kw)
    cfg = json.loads((folder / "config.json").read_text())
    prefix = "model.language_model." if layout == "multimodal" else "model."
    nc = native_config(text_config(cfg), prefix)
    fp = _core.footprint(nc, kw.get("tensor_parallel_size", 1), kw.get("dtype", "float32"), "float32", "float32",
                         False, 2048, 4, 32, 16)
    assert nc.fp8_scales == "block" and int(fp["weights"]) == g.stats()["weight_bytes"]


# --- quantization="fp8" at load ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_gqa2_tied", "qwen35_hybrid"])
def test_quantized_at_load_equals_block_quantization(build, fp8, make_gen, name):
    """quantization="fp8" on the fp32 checkpoint gives the weights of the checkpoint quantized block-wise (the same
    e4m3 values and fp32 scales bit for bit): logprobs equal those of that FP8 checkpoint exactly."""
    folder, ref = fp8(name, scale_dtype=torch.float32)
    online = make_gen(build(name), quantization="fp8")
    stored = make_gen(folder)
    assert online.quantization == "fp8"
    prompts = M.pick_prompts(ref, seed=9, lengths=[4, 25], max_new=8)
    a, b = greedy_and_logprobs(online, prompts, 8), greedy_and_logprobs(stored, prompts, 8)
    assert a == b
    assert online.stats()["weight_bytes"] == stored.stats()["weight_bytes"]


def test_quantized_at_load_from_bf16(build, tmp_path, make_gen):
    """A bf16 checkpoint quantized at load is the block quantization of its bf16 values."""
    src = M.copy_folder(build("qwen3_mha_untied"), tmp_path / "bf16")
    M.save_state(src, {k: v.to(torch.bfloat16) for k, v in M.load_state(src).items()})
    folder = M.to_fp8(src, tmp_path / "fp8", tmp_path / "ref", scale_dtype=torch.float32)
    online = make_gen(src, quantization="fp8", dtype="float32")
    stored = make_gen(folder, dtype="float32")
    prompts = M.pick_prompts(tmp_path / "ref", seed=2, lengths=[6], max_new=6)
    assert greedy_and_logprobs(online, prompts, 6) == greedy_and_logprobs(stored, prompts, 6)
    check_against_reference(stored, tmp_path / "ref", n=6, lengths=(6,))


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.8-27b"])
def test_dummy_fp8_footprint_of_real_shapes(name):
    """quantization="fp8" on real shapes (as load_format="dummy" uses it): the projections at a byte per weight."""
    import qwen_rt.config as C
    from qwen_rt.model_files import resolve, text_config
    cfg = dict(text_config(resolve(name, load_format="dummy").config))
    # A few layers of the real shapes (the 27B's 64 would take minutes on 2 cores).
    cfg.update(num_hidden_layers=4, vocab_size=4096)
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:4]
    nc = C.native_config(cfg, "model.", "fp8")
    f8 = _core.footprint(nc, 1, "bfloat16", "float32", "float32", False, 64, 2, 4, 16)["weights"]
    f16 = _core.footprint(C.native_config(cfg), 1, "bfloat16", "float32", "float32", False, 64, 2, 4, 16)["weights"]
    embed = (1 if cfg.get("tie_word_embeddings") else 2) * cfg["vocab_size"] * cfg["hidden_size"] * 2
    assert 0.5 < (f8 - embed) / (f16 - embed) < 0.53  # projections at a byte per weight, scales and gains beside


def test_dummy_fp8_generates_and_splits_like_one_rank(tmp_path):
    """A small dummy model quantized at load generates, and its TP=2 shards are the TP=1 model's (the blocks are
    those of the whole matrices)."""
    cfg = dict(M.make_config("qwen3_fp8_tp", 384).to_dict())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kw = dict(device="cpu", dtype="float32", load_format="dummy", quantization="fp8", max_batch_size=2,
              kv_cache_memory=1 << 22, progress=False)
    with qwen_rt.Generator(str(tmp_path), **kw) as g1, \
            qwen_rt.Generator(str(tmp_path), tensor_parallel_size=2, **kw) as g2:
        a = g1.generate([[5, 6, 7, 8]], max_tokens=6, logprobs=0, **GREEDY)[0]
        b = g2.generate([[5, 6, 7, 8]], max_tokens=6, logprobs=0, **GREEDY)[0]
    assert g1.quantization == "fp8" and a.token_ids == b.token_ids
    np.testing.assert_allclose([lp[t] for lp, t in zip(a.logprobs, a.token_ids)],
                               [lp[t] for lp, t in zip(b.logprobs, b.token_ids)], atol=1e-5)


# --- tensor parallelism -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,layout", [("qwen3_fp8_tp", "plain"), ("qwen35_fp8_tp", "multimodal")])
def test_fp8_tensor_parallel_equals_one_rank(fp8, make_gen, name, layout):
    folder, ref = fp8(name, layout=layout)
    one, two = make_gen(folder), make_gen(folder, tensor_parallel_size=2)
    prompts = M.pick_prompts(ref, seed=4, lengths=[5, 33], max_new=8)
    t1, l1 = greedy_and_logprobs(one, prompts, 8)
    t2, l2 = greedy_and_logprobs(two, prompts, 8)
    assert t1 == t2
    np.testing.assert_allclose(l1, l2, atol=1e-5)
    check_against_reference(two, ref, n=8, seed=4, lengths=(5,))


def test_fp8_shard_splitting_a_block_is_refused(fp8):
    """o_proj of 64 columns cut in two at TP=2: its 128-column scale blocks would be split."""
    folder, _ = fp8("qwen3_mha_untied")
    with pytest.raises(ValueError, match=r"o_proj'.*tensor_parallel_size 2 splits"):
        qwen_rt.Generator(str(folder), **M.base_kwargs(folder, tensor_parallel_size=2))


# --- bad checkpoints --------------------------------------------------------------------------------------------

def _edited(fp8, tmp_path, edit_state=None, edit_config=None):
    folder, _ = fp8("qwen3_gqa2_tied")
    out = M.copy_folder(folder, tmp_path / "m")
    if edit_state:
        st = M.load_state(out)
        edit_state(st)
        M.save_state(out, st)
    if edit_config:
        M.edit_json(out / "config.json", edit_config)
    return out


SCALE = "model.layers.1.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize("case,needle", [
    ("missing", f"missing tensor '{SCALE}'"),
    ("shape", f"'{SCALE}' has shape \\[2, 1\\]"),
    ("nan", f"'{SCALE}' hold nan"),
    ("inf", f"'{SCALE}' hold inf"),
    ("negative", f"'{SCALE}' hold -"),
    ("int", f"'{SCALE}' has non-float dtype I32"),
])
def test_bad_scales_are_refused(fp8, tmp_path, case, needle):
    def edit(st):
        s = st[SCALE]
        if case == "missing":
            del st[SCALE]
        elif case == "shape":
            st[SCALE] = torch.ones(2, 1, dtype=s.dtype)
        elif case == "int":
            st[SCALE] = torch.ones(s.shape, dtype=torch.int32)
        else:
            s = s.clone()
            s[0, 0] = {"nan": float("nan"), "inf": float("inf"), "negative": -0.5}[case]
            st[SCALE] = s
    out = _edited(fp8, tmp_path, edit)
    with pytest.raises(ValueError, match=needle):
        qwen_rt.Generator(str(out), **M.base_kwargs(out))


def test_fp8_weight_nan_is_refused(fp8, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(st):
        w = st[name].view(torch.uint8).clone()
        w[1, 3] = 0x7F  # e4m3 NaN
        st[name] = w.view(torch.float8_e4m3fn)
    out = _edited(fp8, tmp_path, edit)
    with pytest.raises(ValueError, match=f"'{name}' holds a NaN"):
        qwen_rt.Generator(str(out), **M.base_kwargs(out))


def test_mismatched_checkpoints_are_refused(fp8, build, tmp_path):
    """A module the config keeps unquantized stored as F8_E4M3 (the scales would be ignored), a module the config
    makes FP8 stored in bf16, and an F8_E4M3 tensor without a quantization_config: each a ValueError naming it."""
    up = "model.layers.0.mlp.up_proj"

    def keep(c):
        c["quantization_config"]["modules_to_not_convert"].append(up)
    out = _edited(fp8, tmp_path / "a", edit_config=keep)
    with pytest.raises(ValueError, match=f"'{up}.weight' is F8_E4M3, but the quantization_config keeps"):
        qwen_rt.Generator(str(out), **M.base_kwargs(out))

    def to_bf16(st):
        st[up + ".weight"] = M.fp8_dequantize(st[up + ".weight"], st.pop(up + ".weight_scale_inv")).bfloat16()
    out = _edited(fp8, tmp_path / "b", to_bf16)
    with pytest.raises(ValueError, match=f"'{up}.weight' is BF16, but the quantization_config makes it FP8"):
        qwen_rt.Generator(str(out), **M.base_kwargs(out))

    def drop(c):
        del c["quantization_config"]
    out = _edited(fp8, tmp_path / "c", edit_config=drop)
    with pytest.raises(ValueError, match="is F8_E4M3, but config.json has no FP8 quantization_config"):
        qwen_rt.Generator(str(out), **M.base_kwargs(out))


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["re:("]}, "regular expression"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": "lm_head"}, "list of module"),
])
def test_unsupported_quantization_configs(qc, needle):
    from qwen_rt.config import native_config
    base = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 1024, "quantization_config": qc}
    with pytest.raises(ValueError, match=needle):
        native_config(base)
    with pytest.raises(ValueError, match="quantization must be None or one of fp8"):
        native_config(dict(base, quantization_config=None), quantization="int4")


def test_not_converted_names_match_with_and_without_the_prefix():
    from qwen_rt.config import skips_module
    m = "model.language_model.layers.3.linear_attn.in_proj_a"
    for p in ("model.layers.3.linear_attn.in_proj_a", m, "in_proj_a", "linear_attn.in_proj_a", "model.layers.3",
              "re:.*in_proj_[ab]$", "re:model\\.layers\\.3\\."):
        assert skips_module(p, m), p
    for p in ("model.layers.3.linear_attn.in_proj_b", "proj_a", "model.layers.30", "re:in_proj_a", "lm_head"):
        assert not skips_module(p, m), p
    assert skips_module("model.language_model.layers.0.mlp.up_proj", "model.layers.0.mlp.up_proj")


# --- the CPU FP8 linear against a plain dequantized reference ---------------------------------------------------

def _fp8_matrix(rng, n, k, shift):
    """Random e4m3 values (as float32) and scales [ceil(n / 2^shift), ceil(k / 128)], and the dequantized matrix."""
    q, _ = M.fp8_quantize(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
    s = (rng.random((-(-n // (1 << shift)), -(-k // 128))) * 0.01 + 1e-4).astype(np.float32)
    full = np.repeat(np.repeat(s, 1 << shift, 0), 128, 1)[:n, :k]
    return q.float().numpy(), s, q.float().numpy() * full  # fp32 products


@pytest.mark.parametrize("m,n,k,shift", [(1, 16, 128, 7), (3, 37, 200, 7), (8, 130, 257, 5), (17, 64, 64, 0),
                                         (5, 96, 1000, 3), (33, 20, 130, 7), (40, 300, 136, 7)])
def test_cpu_fp8_linear(m, n, k, shift):
    h = _core.OpHarness("cpu")
    rng = np.random.default_rng(m * 1000 + n + k)
    q, s, deq = _fp8_matrix(rng, n, k, shift)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    ref = x.astype(np.float64) @ deq.T.astype(np.float64) + b
    out = np.asarray(h.fp8_linear("linear", x, q, s, shift, b))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # The products of the dequantized matrix: the fp32 linear on it, bit for bit.
    np.testing.assert_array_equal(out, np.asarray(h.linear(x, deq, b, "float32")))
    # Each row alone gives the same bits (batch invariance).
    alone = np.concatenate([np.asarray(h.fp8_linear("linear", x[i:i + 1], q, s, shift, b)) for i in range(m)])
    np.testing.assert_array_equal(out, alone)
    res = rng.standard_normal((m, n)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(h.fp8_linear("linear_add", x, q, s, shift, res=res)),
                                  np.asarray(h.add(res, np.asarray(h.fp8_linear("linear", x, q, s, shift)))))


def test_cpu_fp8_fused_ops_compose():
    h = _core.OpHarness("cpu")
    rng = np.random.default_rng(3)
    q, s, deq = _fp8_matrix(rng, 2 * 48, 160, 4)
    x = rng.standard_normal((6, 160)).astype(np.float32)
    g = (1 + 0.3 * rng.standard_normal(160)).astype(np.float32)
    normed = np.asarray(h.rms_norm(x, g, 1e-6, False, "float32"))
    np.testing.assert_array_equal(np.asarray(h.fp8_linear("norm_linear", x, q, s, 4, norm_w=g)),
                                  np.asarray(h.fp8_linear("linear", normed, q, s, 4)))
    gu = np.asarray(h.fp8_linear("linear", normed, q, s, 4))
    np.testing.assert_array_equal(np.asarray(h.fp8_linear("norm_linear_silu_mul", x, q, s, 4, norm_w=g)),
                                  np.asarray(h.silu_mul(gu)))


@pytest.mark.parametrize("src_dtype", ["float32", "bfloat16"])
def test_cpu_quantize_fp8_is_block_quantization(src_dtype):
    """Backend::quantize_fp8 against the reference block quantization (torch's e4m3 rounding), with a zero block."""
    rng = np.random.default_rng(1)
    src = (rng.standard_normal((300, 260)) * np.exp(rng.standard_normal((300, 1)))).astype(np.float32)
    src[128:256, 128:256] = 0
    t = torch.from_numpy(src)
    if src_dtype == "bfloat16":
        t = t.bfloat16().float()
    q, s = _core.OpHarness("cpu").quantize_fp8(src, src_dtype)
    rq, rs = M.fp8_quantize(t)
    np.testing.assert_array_equal(np.asarray(s), rs.numpy())
    np.testing.assert_array_equal(np.asarray(q), rq.float().numpy())
    assert np.asarray(s)[1, 1] == 1.0 and not np.asarray(q)[128:256, 128:256].any()


# --- CUDA end to end (the op tests: test_cuda_ops.py) -----------------------------------------------------------

def _cuda():
    try:
        return _core.cuda_device_count() > 0
    except Exception:  # pragma: no cover
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="no CUDA device (or the CUDA plugin is missing)")
@pytest.mark.parametrize("name,layout", [("qwen3_hd128_gqa2", "plain"), ("qwen35_hd256", "multimodal")])
def test_cuda_fp8_checkpoint_matches_transformers(fp8, name, layout, monkeypatch):
    """On the GPU in fp32: transformers' greedy tokens on the dequantized weights (decode through the FP8 GEMV,
    prefill through the dequantizing GEMM, graphs); in bf16 the first token's top-5 logprobs as close to the fp32
    reference as transformers' own bf16 run on those weights (at most twice its error, plus 0.02), weight-only
    (QWEN_RT_FP8_GEMM=dequant) and W8A8 (the prompt's rows: activations quantized per row and 128 columns)."""
    folder, ref = fp8(name, layout=layout)
    kw = dict(device="cuda", max_batch_size=8, gpu_memory_utilization=0.05, progress=False)
    prompts = M.pick_prompts(ref, seed=8, lengths=[3, 40], max_new=10)
    with qwen_rt.Generator(str(folder), dtype="float32", max_num_batched_tokens=16, **kw) as g:
        outs = g.generate(prompts, max_tokens=10, **GREEDY)
    for p, c in zip(prompts, outs):
        msg = M.greedy_mismatch(ref, p, c.token_ids, 10)
        assert not msg, msg
    p = prompts[1]
    want = M.log_softmax(M.hf_logits(str(ref), p))
    hf_bf16 = M.log_softmax(M.hf_logits(str(ref), p, dtype="bfloat16"))
    for form in ("dequant", "w8a8"):
        if form == "dequant":
            monkeypatch.setenv("QWEN_RT_FP8_GEMM", "dequant")
        else:
            monkeypatch.delenv("QWEN_RT_FP8_GEMM", raising=False)
        with qwen_rt.Generator(str(folder), dtype="bfloat16", **kw) as g:
            c = g.generate([p], max_tokens=1, logprobs=5, **GREEDY)[0]
        toks = list(c.logprobs[0])
        ours = max(abs(c.logprobs[0][t] - want[t]) for t in toks)
        theirs = max(abs(hf_bf16[t] - want[t]) for t in toks)
        assert len(toks) >= 5 and ours <= 2 * theirs + 0.02, (form, ours, theirs)


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="no CUDA device (or the CUDA plugin is missing)")
def test_cuda_quantized_at_load_equals_cpu(build, fp8):
    """quantization="fp8" on the GPU (quantize_fp8 kernel) gives the CPU's weights: fp32 greedy tokens equal (the
    reference: the block-quantized checkpoint's dequantized weights)."""
    folder = build("qwen3_hd128_gqa2")
    _, ref = fp8("qwen3_hd128_gqa2", scale_dtype=torch.float32)
    prompts = M.pick_prompts(ref, seed=6, lengths=[5, 20], max_new=8)
    runs = []
    for dev in ("cpu", "cuda"):
        with qwen_rt.Generator(str(folder), device=dev, dtype="float32", quantization="fp8", max_batch_size=4,
                               gpu_memory_utilization=0.05, kv_cache_memory=1 << 24, progress=False) as g:
            runs.append([c.token_ids for c in g.generate(prompts, max_tokens=8, **GREEDY)])
    assert runs[0] == runs[1] == [M.hf_greedy(ref, p, 8) for p in prompts]
