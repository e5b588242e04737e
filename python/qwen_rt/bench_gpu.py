"""GPU benchmark (`qwen-rt bench gpu`): qwen_rt on real Qwen shapes with random weights, against the
physical limits measured in the same run (copy bandwidth, bf16 matmul rate) and side by side with
transformers on the same config.

Figures:
  decode    batch-1 (and batch-N) decode tokens/s and MBU = bytes one step reads / step time / copy bandwidth
  offline   512 requests of 128 prompt + 128 output tokens; 1000 requests with lengths drawn from 32..2048
  prefill   time to first token, prefill tokens/s and MFU for long prompts
  startup   Generator() to first token with the weights in safetensors files on local disk
  longctx   batch-1 decode at long contexts, full attention and sparse (page selection) at several budgets,
            with the bf16 and/or the fp8 KV cache
  kvfp8     the fp8 KV cache's error against the bf16 cache: logprobs of the same greedy continuations
  spec      speculative decoding (MTP): step costs against plain decode, tok/s projected at published acceptance
  gemm      one linear alone on a model's shapes (TP 1) at several row counts: bf16 weights and FP8 (block-128;
            every kernel the FP8 linear launches counted), TFLOP/s
  hf        transformers (sdpa; dynamic cache, static cache, static cache compiled) batch-1 and batch-N
            decode on the same config; with decode, qwen_rt against the fastest of them (end to end)
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def _torch():
    import torch
    return torch


def _median_seconds(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median device time of fn() over reps runs after warmup runs, with CUDA events."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return sorted(times)[len(times) // 2]


def measure_limits() -> dict:
    """Copy bandwidth (bytes read + written) and the dense bf16 matmul rate, through torch."""
    torch = _torch()
    n = 1 << 30  # 1 GiB
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    bw = 2 * n / _median_seconds(lambda: b.copy_(a))
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    flops = 2 * m ** 3 / _median_seconds(lambda: x @ y)
    del x, y
    torch.cuda.empty_cache()
    return {"copy_bw": bw, "bf16_flops": flops}


def _text_config(model: str) -> dict:
    """config.json of a packaged (or hub) model name's language model (model_files.text_config)."""
    from qwen_rt.model_files import resolve, text_config
    return text_config(resolve(model, load_format="dummy").config)


def _hf_config(model: str):
    """transformers' config of a packaged (or hub) model name's language model, architectures kept (Qwen3.5's
    multimodal configs: the text model, Qwen3_5ForCausalLM)."""
    import transformers
    from qwen_rt.model_files import resolve, text_config
    full = resolve(model, load_format="dummy").config
    raw = text_config(full)
    if raw is not full:
        raw = dict(raw, architectures=["Qwen3_5ForCausalLM"])
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items()
                                               if k not in ("architectures", "transformers_version")})
    cfg.architectures = raw.get("architectures")
    return cfg


def _cfg_numbers(cfg: dict) -> dict:
    """Sizes the roofline needs. Hybrid (Qwen3.5) models: attention layers have a q_proj twice as wide (the output
    gate), DeltaNet layers have in_proj (q|k|v, z, a, b) and out_proj, and an fp32 state per sequence."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or H // hq
    inter = cfg["intermediate_size"]
    types = cfg.get("layer_types") or ["full_attention"] * L
    n_attn, n_delta = types.count("full_attention"), types.count("linear_attention")
    gate = 2 if cfg.get("model_type", "").startswith("qwen3_5") else 1
    attn = H * (gate * hq + 2 * hkv) * D + hq * D * H
    hk, hv = cfg.get("linear_num_key_heads", 0), cfg.get("linear_num_value_heads", 0)
    dk, dv = cfg.get("linear_key_head_dim", 0), cfg.get("linear_value_head_dim", 0)
    delta = H * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * H
    return dict(H=H, L=L, V=V, hq=hq, hkv=hkv, D=D, n_attn=n_attn, n_delta=n_delta,
                matmul_params=n_attn * attn + n_delta * delta + L * 3 * H * inter, lm_head=V * H,
                ba_params=n_delta * 2 * hv * H,  # DeltaNet in_proj_b|a: 16-bit in FP8 models too
                kv_bytes_per_token=n_attn * 2 * hkv * D * 2, state_bytes=n_delta * hv * dk * dv * 4,
                delta_flops_per_token=n_delta * hv * dk * dv * 8, tied=bool(cfg.get("tie_word_embeddings")))


def step_bytes(cfg: dict, batch: int, ctx: float, quantization: str | None = None) -> float:
    """Bytes one decode step must read in bf16: every matrix once, the LM head, the norms, the KV of every
    sequence, and each sequence's DeltaNet state read and written (hybrid models). quantization "fp8": the
    projections (but DeltaNet in_proj_b|a) at a byte per weight plus a 4-byte scale per 128 x 128 block."""
    c = _cfg_numbers(cfg)
    norms = c["L"] * (2 * c["H"] + 2 * c["D"]) * 4 + c["H"] * 4
    matrices = 2 * c["matmul_params"]
    if quantization == "fp8":
        fp8 = c["matmul_params"] - c["ba_params"]
        matrices = fp8 + fp8 / (128 * 128) * 4 + 2 * c["ba_params"]
    return (matrices + 2 * c["lm_head"] + norms + batch * ctx * c["kv_bytes_per_token"]
            + batch * 2 * c["state_bytes"])


def prefill_flops(cfg: dict, n: int) -> float:
    """Matmuls, causal attention (n^2 / 2 scores and as many products per head), the DeltaNet recurrence counted
    token by token (decay, read, update, output: 8 dk dv per value head)."""
    c = _cfg_numbers(cfg)
    return (2 * n * c["matmul_params"] + 2 * c["n_attn"] * c["hq"] * c["D"] * n * n + 2 * c["lm_head"]
            + n * c["delta_flops_per_token"])


TP = 1  # --tensor-parallel-size
QUANT = None  # --quantization: None or "fp8" (the dummy weights quantized at load)


def _gen(model, **kw):
    """A Generator for the bench. No prefix cache unless asked: the parts time prompts they ran before (warm-ups,
    repeats), which must be computed again as transformers computes them."""
    from qwen_rt import Generator
    kw.setdefault("tensor_parallel_size", TP)
    kw.setdefault("enable_prefix_caching", False)
    kw.setdefault("quantization", QUANT)
    return Generator(model, device="cuda", dtype="bfloat16", load_format=kw.pop("load_format", "dummy"),
                     progress=False, **kw)


def _prompts(rng, n, length, vocab):
    return [rng.integers(10, vocab - 10, size=length).tolist() for _ in range(n)]


def decode_step(g, prompts, new_tokens: int, **sampling) -> tuple[float, float]:
    """(seconds per decode step, seconds of the whole call): the time of new_tokens tokens less the time of
    one (the prefill), over new_tokens - 1 steps, after a warm-up that captures the graphs of this batch.
    Greedy unless sampling keywords say otherwise."""
    kw = {"ignore_eos": True, "temperature": 0, **sampling}
    g.generate(prompts, max_tokens=4, **kw)
    t = time.perf_counter(); g.generate(prompts, max_tokens=1, **kw)
    t1 = time.perf_counter() - t
    t = time.perf_counter(); g.generate(prompts, max_tokens=new_tokens, **kw)
    tn = time.perf_counter() - t
    return (tn - t1) / (new_tokens - 1), tn


def bench_decode(model: str, batches, prompt_len: int, new_tokens: int, limits: dict, rng,
                 max_model_len: int | None = None) -> list[dict]:
    """max_model_len: the Generator's (None: the prompt and new tokens plus 16; 0: its default, the model's
    whole context)."""
    rows = []
    if max_model_len is None:
        max_model_len = prompt_len + new_tokens + 16
    g = _gen(model, max_batch_size=max(batches), max_model_len=max_model_len or None,
             max_num_batched_tokens=max(2048, prompt_len * max(batches) if prompt_len * max(batches) <= 16384 else 16384))
    cfg = g.config
    try:
        for b in batches:
            ps = _prompts(rng, b, prompt_len, cfg["vocab_size"])
            step, tn = decode_step(g, ps, new_tokens)
            ctx = prompt_len + new_tokens / 2
            mbu = step_bytes(cfg, b, ctx, QUANT) / TP / step / limits["copy_bw"]  # each GPU reads its share
            rows.append({"model": model, "quantization": QUANT, "tp": TP, "batch": b, "step_ms": round(step * 1e3, 3),
                         "decode_tok_s": round(b / step, 1), "mbu": round(mbu, 3),
                         "e2e_tok_s": round(b * new_tokens / tn, 1)})
            if rows[0]["batch"] == 1:  # concurrency speed-up: output tok/s at this batch over batch 1's
                rows[-1]["speedup"] = round(rows[-1]["decode_tok_s"] / rows[0]["decode_tok_s"], 2)
            log(rows[-1])
    finally:
        g.close()
    return rows


def bench_offline(model: str, limits: dict, rng, n_fixed=512, n_random=1000) -> list[dict]:
    rows = []
    g = _gen(model, max_batch_size=512, max_model_len=4096 + 16, max_num_batched_tokens=16384)
    V = g.config["vocab_size"]
    try:
        ps = _prompts(rng, 8, 128, V)
        g.generate(ps, max_tokens=8, ignore_eos=True)
        if n_fixed:
            ps = _prompts(rng, n_fixed, 128, V)
            t = time.perf_counter(); outs = g.generate(ps, max_tokens=128, ignore_eos=True, temperature=0.8, top_p=0.95)
            el = time.perf_counter() - t
            toks = sum(len(o.token_ids) for o in outs)
            rows.append({"model": model, "workload": f"{n_fixed} x 128/128", "output_tok_s": round(toks / el, 1),
                         "total_tok_s": round((toks + 128 * n_fixed) / el, 1), "seconds": round(el, 2)})
            log(rows[-1])
        if n_random:
            lens = rng.integers(32, 2049, size=(n_random, 2))
            ps = [rng.integers(10, V - 10, size=int(p)).tolist() for p, _ in lens]
            from qwen_rt import SamplingParams
            t = time.perf_counter()
            reqs = [g.submit(p, SamplingParams(max_tokens=int(o), ignore_eos=True, temperature=0.8, top_p=0.95))
                    for p, (_, o) in zip(ps, lens)]
            outs = [r.result() for r in reqs]
            el = time.perf_counter() - t
            toks = sum(len(o.token_ids) for o in outs)
            rows.append({"model": model, "workload": f"{n_random} x U(32,2048)/U(32,2048)",
                         "output_tok_s": round(toks / el, 1), "total_tok_s": round((toks + int(lens[:, 0].sum())) / el, 1),
                         "seconds": round(el, 2)})
            log(rows[-1])
        rows[-1]["preemptions"] = g.stats()["preemptions"]
    finally:
        g.close()
    return rows


def bench_prefix(model: str, rng, n=256, prefix_len=2048, suffix_len=64, new_tokens=64) -> list[dict]:
    """n requests that share a prefix_len-token prefix (a system prompt) and go on with suffix_len tokens of their
    own, submitted at once, with the prefix cache on and off: seconds and tokens/s of the whole batch."""
    rows = []
    for caching in (True, False):
        g = _gen(model, max_batch_size=n, max_model_len=prefix_len + suffix_len + new_tokens + 16,
                 max_num_batched_tokens=16384, enable_prefix_caching=caching)
        V = g.config["vocab_size"]
        try:
            g.generate(_prompts(rng, 8, 128, V), max_tokens=8, ignore_eos=True)
            shared = _prompts(rng, 1, prefix_len, V)[0]
            ps = [shared + s for s in _prompts(rng, n, suffix_len, V)]
            before = g.stats()["cached_tokens"]
            t = time.perf_counter(); outs = g.generate(ps, max_tokens=new_tokens, ignore_eos=True, temperature=0)
            el = time.perf_counter() - t
            toks = sum(len(o.token_ids) for o in outs)
            rows.append({"model": model, "workload": f"{n} x ({prefix_len} shared + {suffix_len})/{new_tokens}",
                         "prefix_caching": caching, "seconds": round(el, 2), "output_tok_s": round(toks / el, 1),
                         "prompt_tok_s": round(n * (prefix_len + suffix_len) / el, 1),
                         "cached_tokens": g.stats()["cached_tokens"] - before})
            log(rows[-1])
        finally:
            g.close()
    return rows


def bench_prefill(model: str, lengths, limits: dict, rng) -> list[dict]:
    rows = []
    g = _gen(model, max_batch_size=4, max_model_len=max(lengths) + 16, max_num_batched_tokens=8192)
    cfg = g.config
    try:
        g.generate(_prompts(rng, 1, 512, cfg["vocab_size"]), max_tokens=1)
        for n in lengths:
            p = _prompts(rng, 1, n, cfg["vocab_size"])
            g.generate(p, max_tokens=1, ignore_eos=True)
            best = None
            for _ in range(2):
                t = time.perf_counter(); g.generate(p, max_tokens=1, ignore_eos=True); el = time.perf_counter() - t
                best = el if best is None else min(best, el)
            mfu = prefill_flops(cfg, n) / best / limits["bf16_flops"]
            rows.append({"model": model, "prompt": n, "ttft_ms": round(best * 1e3, 1),
                         "prefill_tok_s": round(n / best, 1), "mfu": round(mfu, 3)})
            log(rows[-1])
    finally:
        g.close()
    return rows


def bench_longctx(model: str, lengths, budgets, new_tokens: int, offload: int, rng, synthetic_from: int = 0,
                  kv_dtypes=("auto",), kv_memory: int = 0, staging=(None,)) -> list[dict]:
    """Batch-1 decode at long contexts, attending to everything ("full") and with sparse attention of each budget:
    the prefill's seconds (once; its pages then come from the prefix cache), decode ms per step, the KV bytes of
    each tier. offload: kv_offload_memory (bytes; 0: none; -1: each context's K/V, 5% and 1,024 tokens more). kv_memory:
    kv_cache_memory, the device pool's bytes (0: what gpu_memory_utilization leaves). Contexts of synthetic_from tokens
    or more (0: none) are random stand-in K/V (synthetic_prefill; labelled so), the host tier's too: decode only.
    kv_dtypes: kv_cache_dtype values to run; staging: kv_staging_pages values to run with sparse attention over a
    host tier (None: the default)."""
    from qwen_rt import SparseAttention
    cfg = _text_config(model)
    max_pos = cfg["max_position_embeddings"]
    c = _cfg_numbers(cfg)
    rows = []
    runs = [(n, kv, b, st) for n in lengths for kv in kv_dtypes for b in [0] + list(budgets)
            for st in (staging if b and offload else (None,))]
    for n, kv, budget, slots in runs:
        synthetic = bool(synthetic_from) and n >= synthetic_from
        sparse = SparseAttention(budget_tokens=budget) if budget else None
        # Beyond max_position_embeddings: yarn, as Qwen's model cards have users set it (factor 4 over 262144 for
        # ~1M tokens on Qwen3.5/3.8).
        need = n + new_tokens + 16
        factor = float(-(-need // max_pos))
        rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": max_pos} \
            if need > max_pos else None
        host = offload
        if offload == -1:  # K/V bytes per token: 16-bit, or e4m3 with an fp32 scale per row and kv head
            per_token = c["kv_bytes_per_token"] // 2 + c["n_attn"] * 2 * c["hkv"] * 4 if kv == "fp8" \
                else c["kv_bytes_per_token"]
            host = int(per_token * (need * 1.05 + 1024))
        g = _gen(model, max_batch_size=1, max_model_len=need, max_num_batched_tokens=8192, rope_scaling=rope,
                 enable_prefix_caching=not synthetic, sparse_attention=sparse, kv_cache_dtype=kv,
                 kv_cache_memory=kv_memory or None, kv_offload_memory=host or None, synthetic_prefill=synthetic,
                 kv_staging_pages=slots)
        try:
            p = _prompts(rng, 1, n, g.config["vocab_size"])
            kw = dict(ignore_eos=True, temperature=0)
            t = time.perf_counter(); g.generate(p, max_tokens=1, **kw); prefill = time.perf_counter() - t
            g.generate(p, max_tokens=4, **kw)  # graphs captured, the prompt's pages cached
            t = time.perf_counter(); g.generate(p, max_tokens=1, **kw); t1 = time.perf_counter() - t
            t = time.perf_counter(); g.generate(p, max_tokens=new_tokens, **kw); tn = time.perf_counter() - t
            step = (tn - t1) / (new_tokens - 1)
            st = g.stats()
            rows.append({"model": model, "quantization": QUANT, "context": n,
                         "kv_cache": "fp8" if kv == "fp8" else "bf16",
                         "attention": f"sparse {budget}" if budget else "full",
                         "rope": f"yarn x{factor:g}" if rope else "default",
                         "prefill_s": "synthetic" if synthetic else round(prefill, 2),
                         "step_ms": round(step * 1e3, 3),
                         "decode_tok_s": round(1 / step, 1), "kv_device_gib": round(st["kv_bytes"] / 2**30, 2),
                         "kv_host_gib": round(st["kv_host_bytes"] / 2**30, 2),
                         "pages_read_on_host": round(st["page_reads_host"] / max(
                             st["page_reads_host"] + st["page_reads_device"], 1), 4),
                         "staging_pages": st["staging_pages"],
                         # of the chosen host pages' reads: from staging frames, and of those, copied in first
                         "staged": round(st["staging_reads"] / max(st["staging_reads"] + st["staging_in_place"], 1), 4),
                         "staging_copied": round(st["staging_copies"] / max(st["staging_reads"], 1), 4),
                         "selected": round(st["sparse_pages_attended"] / st["sparse_pages_held"], 4)
                         if st["sparse_pages_held"] else 1.0})
            log(rows[-1])
        finally:
            g.close()
    return rows


def bench_kv_fp8(model: str, lengths, new_tokens: int, rng) -> list[dict]:
    """The fp8 KV cache against the bf16 one on the same prompt (random weights: the logits are those of no trained
    model, so this measures the numerical error, not a task's accuracy): both greedy continuations, and while they
    agree, per position the KL divergence of the fp8 cache's top-20 distribution from the bf16 one's (over the
    tokens both list) and the largest |logprob| change of the bf16 argmax; argmax_agree counts the positions up to
    the first that differs."""
    rows = []
    for n in lengths:
        p = None
        runs = {}
        for kv in ("auto", "fp8"):
            g = _gen(model, max_batch_size=1, max_model_len=n + new_tokens + 16, max_num_batched_tokens=8192,
                     kv_cache_dtype=kv)
            try:
                if p is None:
                    p = _prompts(rng, 1, n, g.config["vocab_size"])[0]
                runs[kv] = g.generate([p], max_tokens=new_tokens, logprobs=20, temperature=0, ignore_eos=True)[0]
            finally:
                g.close()
        kls, gaps, agree, steps = top20_divergence(runs["auto"], runs["fp8"])
        rows.append({"model": model, "quantization": QUANT, "context": n, "positions": steps,
                     "argmax_agree": f"{agree}/{steps}", "mean_kl_top20": round(sum(kls) / max(len(kls), 1), 6),
                     "max_abs_dlogprob": round(max(gaps, default=0.0), 4)})
        log(rows[-1])
    return rows


def top20_divergence(a, b) -> tuple[list[float], list[float], int, int]:
    """Two greedy completions of one prompt with logprobs=20, a the reference: per position while their tokens agree,
    the KL divergence of b's top-20 distribution from a's (over the tokens both list) and |a's argmax logprob change|;
    then the positions that agree and the positions compared (up to and with the first that differs)."""
    import math
    kls, gaps, agree, steps = [], [], 0, 0
    for la, lb, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
        steps += 1
        agree += ta == tb
        if ta != tb:
            break  # the continuations part: later positions see different prefixes
        common = la.keys() & lb.keys()
        kls.append(sum(math.exp(la[t]) * (la[t] - lb[t]) for t in common))
        gaps.append(abs(la[ta] - lb.get(ta, la[ta])))
    return kls, gaps, agree, steps


def bench_fp8_weights(model: str, limits: dict, rng, prefill_len: int = 8192, kl_prompts: int = 8,
                      kl_len: int = 256, kl_tokens: int = 32) -> list[dict]:
    """FP8 weights (quantization="fp8": the same dummy weights quantized at load) against bf16 in one run: batch-1
    decode (tok/s, MBU), offline 512 x 128/128 (output tok/s), the time to first token of a prefill_len prompt, and
    the error FP8 brings: per position the KL divergence of the next-token distribution (top-20) from bf16's over a
    fixed prompt set (random weights: the numerical error, not a task's accuracy). One row per measure with both
    values and fp8 / bf16."""
    import numpy as np
    global QUANT
    saved, seed = QUANT, int(rng.integers(1 << 30))
    got: dict[str, dict] = {}
    try:
        for q in (None, "fp8"):
            QUANT = q
            r = np.random.default_rng(seed)  # the same prompts for both
            d = bench_decode(model, [1], 512, 128, limits, r)[0]
            o = bench_offline(model, limits, r, n_random=0)[0]
            p = bench_prefill(model, [prefill_len], limits, r)[0]
            g = _gen(model, max_batch_size=kl_prompts, max_model_len=kl_len + kl_tokens + 16)
            try:
                ps = _prompts(np.random.default_rng(seed + 1), kl_prompts, kl_len, g.config["vocab_size"])
                runs = g.generate(ps, max_tokens=kl_tokens, logprobs=20, temperature=0, ignore_eos=True)
            finally:
                g.close()
            got[q or "bf16"] = {"decode b1 tok/s": d["decode_tok_s"], "decode b1 MBU": d["mbu"],
                                "offline 512x128/128 output tok/s": o["output_tok_s"],
                                f"prefill {prefill_len} TTFT ms": p["ttft_ms"], "runs": runs}
    finally:
        QUANT = saved
    rows = [{"model": model, "measure": k, "bf16": got["bf16"][k], "fp8": got["fp8"][k],
             "fp8_over_bf16": round(got["fp8"][k] / got["bf16"][k], 3)} for k in got["bf16"] if k != "runs"]
    kls, gaps, agree, steps = [], [], 0, 0
    for a, b in zip(got["bf16"]["runs"], got["fp8"]["runs"]):
        k_, g_, a_, s_ = top20_divergence(a, b)
        kls += k_; gaps += g_; agree += a_; steps += s_
    rows.append({"model": model, "measure": f"KL(bf16 || fp8), top-20, {kl_prompts} prompts x {kl_tokens} tokens",
                 "bf16": "-", "fp8": round(sum(kls) / max(len(kls), 1), 6),
                 "fp8_over_bf16": f"argmax agree {agree}/{steps}, max |dlogprob| {max(gaps, default=0.0):.4f}"})
    for row in rows:
        log(row)
    return rows


def gemm_shapes(model: str) -> list[tuple[str, int, int]]:
    """(linear, N, K) of each distinct linear of a packaged model at TP 1, fused as the runtime stores them (q|k|v
    with the output gate of gated attention, gate|up; DeltaNet's q|k|v|z), the LM head left out."""
    cfg = _text_config(model)
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nq
    hybrid = "linear_num_value_heads" in cfg
    shapes = [("attention q|k|v" + ("|gate" if hybrid else ""), nq * hd * (2 if hybrid else 1) + 2 * nkv * hd, H),
              ("attention o", H, nq * hd), ("mlp gate|up", 2 * inter, H), ("mlp down", H, inter)]
    if hybrid:
        qk = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        vn = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        shapes += [("deltanet q|k|v|z", 2 * qk + 2 * vn, H), ("deltanet out", H, vn)]
    return shapes


def bench_gemm(model: str, rows, repeats: int = 20) -> list[dict]:
    """Each linear of gemm_shapes(model) alone (the op harness: random device data, `repeats` calls timed together
    after one), bf16 and FP8 weights, at each row count: ms a call and TFLOP/s (2 M N K). FP8 counts what the FP8
    linear launches at that size (at 1024 rows and more: the activations' quantization, the scales' transpose and the
    W8A8 GEMM)."""
    from qwen_rt import _core
    h = _core.OpHarness("cuda", "bfloat16")
    out = []
    for name, n, k in gemm_shapes(model):
        for m in rows:
            row = {"model": model, "linear": name, "m": m, "n": n, "k": k}
            for w in ("act", "fp8"):
                sec = h.time_linear(m, n, k, w, repeats)
                tag = "bf16" if w == "act" else "fp8"
                row[f"{tag}_ms"] = round(sec * 1e3, 4)
                row[f"{tag}_tflops"] = round(2 * m * n * k / sec / 1e12, 1)
            row["fp8_over_bf16"] = round(row["bf16_ms"] / row["fp8_ms"], 3)
            log(row)
            out.append(row)
    return out


# Published acceptance of Qwen's MTP drafts for this architecture, per draft position (the projection's inputs).
MTP_ACCEPTANCE = (0.885, 0.740)


def bench_spec(model: str, batches, ks, prompt_len: int, new_tokens: int, rng) -> list[dict]:
    """Speculative decoding's costs at each batch: the time of a step that verifies k drafts and drafts k more,
    against a plain decode step (random weights: drafts are rejected, every step emits one token per request); and
    tok/s projected at the published acceptance (labelled: measured step time x expected tokens per step)."""
    rows = []
    for k in [0] + list(ks):
        g = _gen(model, max_batch_size=max(batches), max_model_len=prompt_len + new_tokens + 16,
                 speculative_tokens=k, speculative_max_batch=max(batches))
        try:
            for b in batches:
                ps = _prompts(rng, b, prompt_len, g.config["vocab_size"])
                kw = dict(ignore_eos=True, temperature=0)
                g.generate(ps, max_tokens=4, **kw)
                t = time.perf_counter(); g.generate(ps, max_tokens=1, **kw); t1 = time.perf_counter() - t
                s0 = g.stats()["steps"]
                t = time.perf_counter(); g.generate(ps, max_tokens=new_tokens, **kw); tn = time.perf_counter() - t
                steps = g.stats()["steps"] - s0 - 1
                step = (tn - t1) / max(steps, 1)
                expected = 1 + sum(MTP_ACCEPTANCE[:k]) if k <= len(MTP_ACCEPTANCE) else None
                row = {"model": model, "quantization": QUANT, "batch": b, "speculative_tokens": k,
                       "step_ms": round(step * 1e3, 3), "measured_tok_s": round(b * new_tokens / tn, 1)}
                if k == 0:
                    row["plain_step_ms"] = row["step_ms"]
                else:
                    base = next(r for r in rows if r["batch"] == b and r["speculative_tokens"] == 0)
                    row["step_vs_plain"] = round(step * 1e3 / base["step_ms"], 3)
                    if expected:
                        row["projected_tok_s"] = round(b * expected / step, 1)
                        row["projected_vs_plain"] = round(expected * base["step_ms"] / (step * 1e3), 2)
                rows.append(row)
                log(row)
        finally:
            g.close()
    return rows


def bench_hf(model: str, batches, prompt_len: int, new_tokens: int, rng, caches=("dynamic", "static")) -> list[dict]:
    """transformers on the same config (random weights), sdpa, dynamic and static cache."""
    torch = _torch()
    import transformers
    cfg = _hf_config(model)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    rows = []
    try:
        for b in batches:
            ids = torch.tensor(_prompts(rng, b, prompt_len, cfg.vocab_size), device="cuda")
            for cache in caches:
                kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
                if cache.startswith("static"):
                    kw["cache_implementation"] = "static"
                    # transformers compiles the static-cache step unless told not to; "static+compile"
                    # keeps that, and its warm-up below has the full length so compilation is not timed.
                    kw["disable_compile"] = cache == "static"
                warm = kw if cache == "static+compile" else {**kw, "max_new_tokens": 4, "min_new_tokens": 4}
                try:
                    with torch.inference_mode():
                        m.generate(ids, **warm)
                        torch.cuda.synchronize()
                        t = time.perf_counter(); m.generate(ids, **kw); torch.cuda.synchronize()
                        el = time.perf_counter() - t
                    rows.append({"model": model, "impl": f"transformers sdpa {cache}", "batch": b,
                                 "e2e_tok_s": round(b * new_tokens / el, 1)})
                except Exception as e:  # report, do not hide
                    rows.append({"model": model, "impl": f"transformers sdpa {cache}", "batch": b,
                                 "error": f"{type(e).__name__}: {str(e)[:120]}"})
                log(rows[-1])
    finally:
        del m
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def bench_startup(model: str, rng) -> list[dict]:
    """Writes random weights of the model's shape as safetensors, then times Generator() -> first token."""
    torch = _torch()
    import transformers
    cfg = _hf_config(model)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("QWEN_RT_BENCH_DIR")) as d:
        with torch.device("cuda"):
            m = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        t = time.perf_counter(); m.save_pretrained(d); el_save = time.perf_counter() - t
        del m
        gc.collect(); torch.cuda.empty_cache()
        os.sync()
        from qwen_rt import Generator
        t = time.perf_counter()
        g = Generator(d, device="cuda", progress=False, max_batch_size=8, max_model_len=4096, tensor_parallel_size=TP,
                      enable_prefix_caching=False, quantization=QUANT)
        t_init = time.perf_counter() - t
        g.generate([[1, 2, 3, 4]], max_tokens=1)
        t_first = time.perf_counter() - t
        g.close()
        rows.append({"model": model, "save_s": round(el_save, 1), "generator_s": round(t_init, 2),
                     "to_first_token_s": round(t_first, 2)})
        log(rows[-1])
    return rows


def side_by_side(decode_rows: list[dict], hf_rows: list[dict]) -> list[dict]:
    """qwen_rt against the fastest transformers configuration of the same run, per batch of the hf model:
    end-to-end tokens/s of both (the same prompts, new tokens and timing) and their ratio. Rows that failed
    (an "error" instead of a speed) do not count; a batch missing on either side is left out."""
    out = []
    for d in decode_rows:
        hf = [h for h in hf_rows if h["model"] == d["model"] and h["batch"] == d["batch"] and "e2e_tok_s" in h]
        if not hf or d.get("tp", 1) != 1:
            continue
        best = max(hf, key=lambda h: h["e2e_tok_s"])
        out.append({"model": d["model"], "batch": d["batch"], "qwen_rt_e2e_tok_s": d["e2e_tok_s"],
                    "best_transformers": best["impl"].removeprefix("transformers "),
                    "transformers_e2e_tok_s": best["e2e_tok_s"],
                    "ratio": round(d["e2e_tok_s"] / best["e2e_tok_s"], 2)})
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("gpu", help="qwen_rt on the GPU: decode/offline/prefill/startup vs the roofline and transformers")
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b,qwen3-32b")
    p.add_argument("--parts", default="decode,offline,prefix,prefill,hf,startup")
    p.add_argument("--decode-batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--decode-max-model-len", type=int, default=None,
                   help="the decode Generators' max_model_len (default: prompt + new tokens + 16; 0: the model's)")
    p.add_argument("--offline-model", default="qwen3-8b")
    p.add_argument("--offline-random", type=int, default=1000)
    p.add_argument("--prefill-model", default="qwen3-8b")
    p.add_argument("--prefill-lengths", default="1024,8192,32768")
    p.add_argument("--hf-model", default="qwen3-8b")
    p.add_argument("--hf-caches", default="dynamic,static,static+compile", help="dynamic, static, static+compile")
    p.add_argument("--startup-models", default="qwen3-0.6b,qwen3-8b")
    p.add_argument("--spec-model", default="qwen3.8-27b")
    p.add_argument("--gemm-model", default="qwen3.8-27b", help="--parts gemm: the model whose linears are timed")
    p.add_argument("--gemm-rows", default="1,8,32,1024,4096,8192", help="--parts gemm: x rows")
    p.add_argument("--spec-batches", default="1,8,32")
    p.add_argument("--spec-tokens", default="1,2", help="speculative_tokens values besides 0")
    p.add_argument("--longctx-model", default="qwen3.8-27b")
    p.add_argument("--longctx-lengths", default="4096,32768,131072")
    p.add_argument("--longctx-budgets", default="2048,4096", help="sparse attention budgets (tokens) besides full")
    p.add_argument("--longctx-offload", type=int, default=0,
                   help="kv_offload_memory in bytes (0: none; -1: each context's K/V, 5%% and 1,024 tokens more)")
    p.add_argument("--longctx-staging", default="auto",
                   help="kv_staging_pages values to run with sparse attention over a host tier (auto: the default)")
    p.add_argument("--longctx-kv-memory", type=int, default=0,
                   help="kv_cache_memory: the device KV pool in bytes (0: what gpu_memory_utilization leaves)")
    p.add_argument("--longctx-kv", default="auto", help="kv_cache_dtype values to run: auto, fp8 or auto,fp8")
    p.add_argument("--kvfp8-model", default="qwen3.8-27b")
    p.add_argument("--fp8-model", default="qwen3-8b", help="--parts fp8: FP8 weights against bf16 (issue 31's table)")
    p.add_argument("--kvfp8-lengths", default="4096,32768")
    p.add_argument("--longctx-synthetic-from", type=int, default=262144,
                   help="contexts of this many tokens or more decode over random stand-in K/V (0: never)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) per Generator")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the weights quantized at load (block-128 FP8, as Qwen's FP8 checkpoints); the "
                        "roofline counts the FP8 bytes and scales")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append the record (one JSON line) to this file")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="draw decode tok/s against batch (with the roofline) and prefill MFU into a PNG (matplotlib)")


def run(args) -> int:
    import numpy as np
    from qwen_rt.bench import _git_commit
    from qwen_rt.cli import print_table
    rng = np.random.default_rng(args.seed)
    global TP, QUANT
    TP = args.tensor_parallel_size
    QUANT = args.quantization
    parts = set(x.strip() for x in args.parts.split(","))
    limits = measure_limits()
    log(f"measured: copy {limits['copy_bw'] / 1e12:.2f} TB/s, bf16 matmul {limits['bf16_flops'] / 1e12:.0f} TFLOP/s")
    torch = _torch()
    rec = {"device": torch.cuda.get_device_name(0), "limits": limits, "date": time.strftime("%Y-%m-%d"),
           "commit": _git_commit(), "quantization": QUANT}
    def done(part):  # prints a part's table; with --json, the record so far goes to <json>.partial
        print_table(rec[part])
        if args.json:
            Path(args.json + ".partial").write_text(json.dumps(rec) + "\n")

    batches = [int(x) for x in args.decode_batches.split(",")]
    if "decode" in parts:
        rec["decode"] = []
        for m in args.models.split(","):
            rec["decode"] += bench_decode(m, batches, args.prompt_len, args.new_tokens, limits, rng,
                                          args.decode_max_model_len)
        done("decode")
    if "hf" in parts:
        rec["hf"] = bench_hf(args.hf_model, batches, args.prompt_len, args.new_tokens, rng, args.hf_caches.split(","))
        done("hf")
        if rec.get("decode"):
            rec["vs_hf"] = side_by_side(rec["decode"], rec["hf"])
            done("vs_hf")
    if "offline" in parts:
        rec["offline"] = bench_offline(args.offline_model, limits, rng, n_random=args.offline_random)
        done("offline")
    if "prefix" in parts:
        rec["prefix"] = bench_prefix(args.offline_model, rng)
        done("prefix")
    if "prefill" in parts:
        rec["prefill"] = bench_prefill(args.prefill_model, [int(x) for x in args.prefill_lengths.split(",")], limits, rng)
        done("prefill")
    if "spec" in parts:
        rec["spec"] = bench_spec(args.spec_model, [int(x) for x in args.spec_batches.split(",")],
                                 [int(x) for x in args.spec_tokens.split(",") if x], args.prompt_len,
                                 max(args.new_tokens, 8), rng)
        done("spec")
    if "gemm" in parts:
        rec["gemm"] = bench_gemm(args.gemm_model, [int(x) for x in args.gemm_rows.split(",")])
        done("gemm")
    if "longctx" in parts:
        rec["longctx"] = bench_longctx(args.longctx_model, [int(x) for x in args.longctx_lengths.split(",")],
                                       [int(x) for x in args.longctx_budgets.split(",") if x],
                                       max(args.new_tokens, 8), args.longctx_offload, rng,
                                       args.longctx_synthetic_from, args.longctx_kv.split(","),
                                       args.longctx_kv_memory,
                                       [None if x == "auto" else int(x) for x in args.longctx_staging.split(",")])
        done("longctx")
    if "fp8" in parts:
        rec["fp8"] = bench_fp8_weights(args.fp8_model, limits, rng)
        done("fp8")
    if "kvfp8" in parts:
        rec["kvfp8"] = bench_kv_fp8(args.kvfp8_model, [int(x) for x in args.kvfp8_lengths.split(",")],
                                    max(args.new_tokens, 16), rng)
        done("kvfp8")
    if "startup" in parts:
        rec["startup"] = []
        for m in args.startup_models.split(","):
            rec["startup"] += bench_startup(m, rng)
        done("startup")
    line = json.dumps(rec)
    print(line)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
        Path(args.json + ".partial").unlink(missing_ok=True)
    if args.plot:
        from qwen_rt.bench_plot import plot_record
        plot_record(rec, args.plot)
        log(f"plot: {args.plot}")
    return 0
