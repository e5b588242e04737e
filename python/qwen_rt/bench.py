"""Benchmarks: `qwen-rt bench MODE ...` or `python -m qwen_rt.bench MODE ...`.

Modes:
  gpu   real Qwen shapes with random weights on a CUDA GPU: decode MBU, offline throughput, prefill MFU,
        startup, side by side with transformers (see bench_gpu.py)
  cpu   a random ~100M-parameter Qwen3 model: HF transformers' generate (its best configuration) vs
        qwen_rt.Generator on the CPU, side by side in one run, greedy, fixed numbers of tokens;
        with --phases, qwen_rt alone by phase (prefill, decode at each batch size) on random weights.

Speed is reported as output tokens/s (batch * new tokens / wall time of one generate call, prefill
included) and as the ratio qwen_rt / best transformers at the same batch size. A JSON line records
the run (stdout, and appended to --json PATH).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

# The CPU benchmark model: ~100M parameters (embeddings 25.2M, 12 layers of 6.3M), tied embeddings.
BENCH_MODEL_CPU = dict(
    vocab_size=32768,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _csv(s: str, cast=str) -> list:
    return [cast(x.strip()) for x in s.split(",") if x.strip()]


def _print_table(rows, file=None, columns=None):
    from qwen_rt.cli import print_table
    print_table(rows, file=file, columns=columns)


def _git_commit() -> str | None:
    """The measured code's commit: QWEN_RT_COMMIT when set (an installed copy or a device machine's tree
    may not know it), else the git checkout the package runs from."""
    if os.environ.get("QWEN_RT_COMMIT"):
        return os.environ["QWEN_RT_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:
        return None


def _qwen_rt_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("qwen_rt")
    except Exception:
        return None


def _record(mode: str, args, extra: dict) -> dict:
    rec = {
        "bench": mode,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "qwen_rt": _qwen_rt_version(),
        "argv": list(getattr(args, "argv", [])),
    }
    rec.update(extra)
    return rec


def _emit_record(rec: dict, path: str | None) -> None:
    line = json.dumps(rec, sort_keys=False)
    print(line)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


# ----------------------------------------------------------------------------------------------------
# cpu

def _missing_reference() -> str | None:
    """Why transformers cannot run beside qwen_rt here (None: it can)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return (f"{e.name or e} is not installed; for the side-by-side run: pip install torch --index-url "
                "https://download.pytorch.org/whl/cpu && pip install transformers")
    return None


def _bench_model_params(cfg: dict) -> int:
    """Parameters of the bench model (tied embeddings counted once)."""
    H, inter, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layer = H * (q + 2 * kv) * D + q * D * H + 3 * H * inter + 2 * H + 2 * D
    return V * H + L * layer + H


def _write_dummy_cpu_model(workdir: Path) -> Path:
    """The bench model's config alone: qwen_rt draws its random weights (load_format="dummy"); no torch needed."""
    d = workdir / "qwen3-100m-dummy"
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
           **BENCH_MODEL_CPU}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def measure_copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes a second that one memory copy moves on the CPU (read + written), best of three: the roofline's
    bandwidth (a single-threaded copy, so a lower bound on what all cores can read)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return 2 * nbytes / best


def _build_cpu_model(workdir: Path, seed: int) -> tuple[dict[str, Path], int, dict]:
    """Random Qwen3 model saved with transformers as float32 and bfloat16 safetensors folders."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**BENCH_MODEL_CPU)
    model = Qwen3ForCausalLM(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    folders = {}
    for dt_name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        d = workdir / f"qwen3-100m-{dt_name}"
        model.to(dt).save_pretrained(d, safe_serialization=True)
        folders[dt_name] = d
    del model
    return folders, n_params, dict(BENCH_MODEL_CPU)


def _hf_load(folder: Path, dtype: str, attn: str):
    import torch
    from transformers import AutoModelForCausalLM

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=tdt, attn_implementation=attn)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        m = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=tdt, attn_implementation=attn)
    return m.eval()


def _hf_generate(model, input_ids, new_tokens: int, cache: str):
    import torch

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(input_ids))
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids, **kw)
        dt = time.perf_counter() - t0
    n = out.shape[1] - input_ids.shape[1]
    if n != new_tokens:
        raise RuntimeError(f"generated {n} tokens, expected {new_tokens}")
    return dt, out[:, input_ids.shape[1]:].tolist()


LOGPROB_TOP = 20  # the closeness check compares the first generated token's top-20 log-probabilities


def _hf_first_logprobs(model, input_ids) -> np.ndarray:
    """log_softmax of the next-token logits after each prompt (fp32), [batch, vocab]."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids, attention_mask=torch.ones_like(input_ids)).logits[:, -1].float()
    return torch.log_softmax(logits, -1).numpy()


def _top(row: np.ndarray, k: int) -> dict[int, float]:
    ids = np.argpartition(-row, k)[:k]
    return {int(i): float(row[i]) for i in ids}


def _logprob_error(tops: list[dict[int, float]], ref: np.ndarray) -> float:
    """Largest |log p - reference log p| over the tokens in both a prompt's top list and the reference's top
    list (float32 transformers), over the prompts."""
    err = 0.0
    for top, ref_row in zip(tops, ref):
        for t in top.keys() & _top(ref_row, LOGPROB_TOP).keys():
            err = max(err, abs(top[t] - float(ref_row[t])))
    return err


def run_cpu(args) -> int:
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    missing = _missing_reference()
    if missing and not args.skip_hf:
        log(f"transformers is not measured beside qwen_rt: {missing}")
        args.skip_hf = True
    threads = args.threads or os.cpu_count() or 1
    if not missing:
        import torch
        import transformers
        try:
            transformers.utils.logging.disable_progress_bar()
        except Exception:
            pass
        torch.set_num_threads(threads)
    batch_sizes = _csv(args.batch_sizes, int)
    P, N = args.prompt_len, args.new_tokens
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="qwen_rt_bench_")) if own_dir else Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not args.skip_hf:
        log("the side-by-side run takes ~13 minutes on 2 cores at the defaults, mostly transformers' "
            "configurations (--skip-hf: qwen_rt alone)")

    try:
        load_format = "auto"
        if missing:  # no torch to write weights with: qwen_rt draws them from the config
            dummy = _write_dummy_cpu_model(workdir)
            folders, n_params, model_cfg = {"float32": dummy, "bfloat16": dummy}, \
                _bench_model_params(BENCH_MODEL_CPU), dict(BENCH_MODEL_CPU)
            load_format = "dummy"
        else:
            folders, n_params, model_cfg = _build_cpu_model(workdir, args.seed)
        log(f"bench model: Qwen3, {n_params / 1e6:.1f}M parameters (hidden {model_cfg['hidden_size']}, "
            f"{model_cfg['num_hidden_layers']} layers, {model_cfg['num_attention_heads']}/"
            f"{model_cfg['num_key_value_heads']} heads x {model_cfg['head_dim']}, inter "
            f"{model_cfg['intermediate_size']}, vocab {model_cfg['vocab_size']}, tied) in {workdir}")
        log(f"threads {threads}, prompt {P} tokens, {N} new tokens, batch sizes {batch_sizes}, "
            f"{args.repeats} timed run(s) after one warm-up")
        rng = np.random.default_rng(args.seed)
        prompts = rng.integers(3, model_cfg["vocab_size"], size=(max(batch_sizes), P)).tolist()

        results: list[dict] = []
        tokens: dict[tuple, list] = {}
        first_lp: dict[str, np.ndarray] = {}        # transformers' first-token log-probabilities by dtype
        first_top: dict[str, list[dict]] = {}      # qwen_rt's first-token top lists by dtype

        # -- transformers ------------------------------------------------------------------------
        if not args.skip_hf:
            for dtype in _csv(args.hf_dtypes):
                for attn in _csv(args.hf_attn):
                    try:
                        model = _hf_load(folders.get(dtype, folders["float32"]), dtype, attn)
                    except Exception as e:
                        log(f"transformers {dtype}/{attn}: load failed: {type(e).__name__}: {e}")
                        continue
                    if dtype not in first_lp:
                        try:
                            first_lp[dtype] = _hf_first_logprobs(model, torch.tensor(prompts, dtype=torch.long))
                        except Exception as e:
                            log(f"transformers {dtype}/{attn}: logits failed: {type(e).__name__}: {e}")
                    for cache in _csv(args.hf_cache):
                        for bs in batch_sizes:
                            row = {"engine": "transformers", "dtype": dtype, "variant": f"{attn}/{cache}",
                                   "batch": bs}
                            ids = torch.tensor(prompts[:bs], dtype=torch.long)
                            try:
                                _hf_generate(model, ids, N, cache)  # warm-up
                                best, out = None, None
                                for _ in range(args.repeats):
                                    dt, out = _hf_generate(model, ids, N, cache)
                                    best = dt if best is None else min(best, dt)
                                row.update(time_s=best, tok_s=bs * N / best)
                                tokens[("transformers", dtype, attn, cache, bs)] = out
                            except Exception as e:
                                row.update(time_s=None, tok_s=None, error=f"{type(e).__name__}: {e}"[:200])
                            log(f"  transformers {dtype} {attn}/{cache} batch {bs}: "
                                + (f"{row['tok_s']:.1f} tok/s" if row.get("tok_s") else row.get("error", "")))
                            results.append(row)
                    del model

        # -- qwen_rt -----------------------------------------------------------------------------
        qrt_error = None
        if not args.skip_qwen_rt:
            try:
                from qwen_rt import Generator
            except Exception as e:
                qrt_error = f"{type(e).__name__}: {e}"
                log(f"qwen_rt unavailable: {qrt_error}")
                Generator = None
            if Generator is not None:
                for dtype in _csv(args.dtype):
                    folder = folders.get(dtype, folders["float32"])
                    try:
                        # No prefix cache: the timed runs repeat the warm-up's prompts, which transformers
                        # computes again each time.
                        kw = dict(device="cpu", dtype=dtype, max_batch_size=max(batch_sizes),
                                  max_model_len=max(P + N + 16, 256), seed=args.seed, enable_prefix_caching=False,
                                  load_format=load_format)
                        try:
                            gen = Generator(str(folder), num_threads=threads, progress=False, **kw)
                        except TypeError:  # an older Generator (no num_threads, no prefix cache)
                            kw.pop("enable_prefix_caching")
                            gen = Generator(str(folder), **kw)
                    except Exception as e:
                        log(f"qwen_rt {dtype}: Generator failed: {type(e).__name__}: {e}")
                        results.append({"engine": "qwen_rt", "dtype": dtype, "variant": "", "batch": None,
                                        "time_s": None, "tok_s": None, "error": f"{type(e).__name__}: {e}"[:200]})
                        continue
                    try:
                        for bs in batch_sizes:
                            row = {"engine": "qwen_rt", "dtype": dtype, "variant": "", "batch": bs}
                            try:
                                def once():
                                    t0 = time.perf_counter()
                                    outs = gen.generate(prompts[:bs], max_tokens=N, temperature=0.0, ignore_eos=True)
                                    dt = time.perf_counter() - t0
                                    bad = [len(o.token_ids) for o in outs if len(o.token_ids) != N]
                                    if len(outs) != bs or bad:
                                        raise RuntimeError(f"expected {bs} x {N} tokens, got lengths "
                                                           f"{[len(o.token_ids) for o in outs]}")
                                    return dt, [list(o.token_ids) for o in outs]
                                once()  # warm-up
                                best, out = None, None
                                for _ in range(args.repeats):
                                    dt, out = once()
                                    best = dt if best is None else min(best, dt)
                                row.update(time_s=best, tok_s=bs * N / best)
                                tokens[("qwen_rt", dtype, bs)] = out
                            except Exception as e:
                                row.update(time_s=None, tok_s=None, error=f"{type(e).__name__}: {e}"[:200])
                            log(f"  qwen_rt {dtype} batch {bs}: "
                                + (f"{row['tok_s']:.1f} tok/s" if row.get("tok_s") else row.get("error", "")))
                            results.append(row)
                        try:
                            outs = gen.generate(prompts, max_tokens=1, temperature=0.0, logprobs=LOGPROB_TOP)
                            first_top[dtype] = [o.logprobs[0] for o in outs]
                        except Exception as e:
                            log(f"qwen_rt {dtype}: logprobs failed: {type(e).__name__}: {e}")
                    finally:
                        gen.close()

        # -- ratios ------------------------------------------------------------------------------
        best_hf = {}
        best_hf_dtype = {}
        for r in results:
            if r["engine"] == "transformers" and r.get("tok_s"):
                b = r["batch"]
                if r["tok_s"] > best_hf.get(b, (0, ""))[0]:
                    best_hf[b] = (r["tok_s"], f"{r['dtype']} {r['variant']}")
                k = (b, r["dtype"])
                best_hf_dtype[k] = max(best_hf_dtype.get(k, 0.0), r["tok_s"])
        for r in results:
            if r["engine"] == "qwen_rt" and r.get("tok_s") and r["batch"] in best_hf:
                r["x_best_hf"] = r["tok_s"] / best_hf[r["batch"]][0]
                if (r["batch"], r["dtype"]) in best_hf_dtype:
                    r["x_hf_same_dtype"] = r["tok_s"] / best_hf_dtype[(r["batch"], r["dtype"])]

        # Greedy agreement (information only: random weights give flat logits, so near-ties may flip).
        agreement = {}
        for (eng, *rest), toks in tokens.items():
            if eng != "qwen_rt":
                continue
            dtype, bs = rest
            ref = tokens.get(("transformers", dtype, "sdpa", "dynamic", bs)) or next(
                (v for k, v in tokens.items() if k[0] == "transformers" and k[1] == dtype and k[-1] == bs), None)
            if ref is None:
                continue
            prefix = []
            for a, b in zip(toks, ref):
                n = 0
                while n < min(len(a), len(b)) and a[n] == b[n]:
                    n += 1
                prefix.append(n)
            agreement[f"{dtype}/b{bs}"] = {"min_common_prefix": min(prefix), "mean_common_prefix":
                                           sum(prefix) / len(prefix), "of": N}

        # Closeness (what greedy agreement cannot show on flat random logits): the first token's log-probabilities
        # of each engine and dtype against transformers in float32.
        closeness = {}
        if "float32" in first_lp:
            ref = first_lp["float32"]
            for dtype, tops in first_top.items():
                closeness[f"qwen_rt/{dtype}"] = _logprob_error(tops, ref)
            for dtype, lp in first_lp.items():
                if dtype != "float32":
                    closeness[f"transformers/{dtype}"] = _logprob_error([_top(r, LOGPROB_TOP) for r in lp], ref)

        print("", file=sys.stderr)
        cols = ["engine", "dtype", "variant", "batch", "time_s", "tok_s", "x_best_hf", "x_hf_same_dtype", "error"]
        if not any("error" in r for r in results):
            cols.remove("error")
        _print_table(results, file=sys.stderr, columns=cols)
        summary = []
        for b in batch_sizes:
            q = [r for r in results if r["engine"] == "qwen_rt" and r["batch"] == b and r.get("tok_s")]
            qbest = max(q, key=lambda r: r["tok_s"]) if q else None
            summary.append({
                "batch": b,
                "best transformers": f"{best_hf[b][0]:.1f} tok/s ({best_hf[b][1]})" if b in best_hf else "-",
                "best qwen_rt": f"{qbest['tok_s']:.1f} tok/s ({qbest['dtype']})" if qbest else "-",
                "qwen_rt / transformers": (qbest["tok_s"] / best_hf[b][0]) if (qbest and b in best_hf) else None,
            })
        print("", file=sys.stderr)
        _print_table(summary, file=sys.stderr)
        if agreement:
            print("greedy agreement with transformers (common prefix of token ids, of "
                  f"{N}): " + ", ".join(f"{k}: min {v['min_common_prefix']}" for k, v in agreement.items()),
                  file=sys.stderr)
        if closeness:
            print(f"first-token log-probabilities against transformers float32 (largest |difference| over both "
                  f"top-{LOGPROB_TOP} lists, {len(prompts)} prompts): "
                  + ", ".join(f"{k} {v:.2g}" for k, v in closeness.items()), file=sys.stderr)
        if qrt_error:
            print(f"qwen_rt was not measured: {qrt_error}", file=sys.stderr)

        copy_bw = measure_copy_bandwidth()
        rec = _record("cpu", args, {
            "threads": threads,
            "torch": None if missing else torch.__version__,
            "transformers": None if missing else transformers.__version__,
            "reference_missing": missing,
            "limits": {"copy_bw": copy_bw},
            "model": {"params": n_params, **{k: model_cfg[k] for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings")}},
            "prompt_len": P,
            "new_tokens": N,
            "repeats": args.repeats,
            "results": results,
            "ratio_vs_best_hf": {str(s["batch"]): s["qwen_rt / transformers"] for s in summary},
            "greedy_agreement": agreement,
            "first_logprob_error_vs_hf_float32": closeness,
            "qwen_rt_error": qrt_error,
        })
        _emit_record(rec, args.json)
        if args.plot:
            from qwen_rt.bench_plot import plot_record
            plot_record(rec, args.plot)
            log(f"plot: {args.plot}")
        return 0
    finally:
        if own_dir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _phase_cfg(args) -> dict:
    """The bench model with --layers / --vocab applied (issue 35's model: --layers 10 --vocab 32000)."""
    cfg = dict(BENCH_MODEL_CPU)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    if args.vocab:
        cfg["vocab_size"] = args.vocab
    return cfg


def run_cpu_phases(args) -> int:
    """qwen_rt alone, by phase, on random weights drawn from the config: prefill of one --prefill-len prompt
    (tokens/s, and GFLOP/s of its linear layers and attention), and decode steps at each batch size (the time of 72 generated
    tokens less that of 8, over 64 steps; bytes of weights + KV read per step / step time). Dtypes alternate
    over --repeats rounds; the best of each counts (the VM is shared)."""
    from qwen_rt import Generator
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cfg = _phase_cfg(args)
    threads = args.threads or os.cpu_count() or 1
    batch_sizes, P, dtypes = _csv(args.batch_sizes, int), args.prefill_len, _csv(args.dtype)
    peer = args.peer == "llama.cpp"
    if args.peer not in (None, "llama.cpp"):
        raise ValueError(f"--peer {args.peer!r}: only 'llama.cpp'")
    if peer:
        from qwen_rt import bench_llama_cpp as llama
        why = llama.missing()
        if why:
            raise ValueError(why)
        converter = llama.find_converter(args.peer_converter)
    n_params = _bench_model_params(cfg)
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv_row = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]  # K and V elements per token per layer
    linear_params = n_params - H - L * (2 * H + 2 * cfg["head_dim"])  # the matrices (norms left out)
    workdir = Path(tempfile.mkdtemp(prefix="qwen_rt_phases_"))
    folder = workdir / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16", **cfg}))
    rng = np.random.default_rng(args.seed)
    short = 16
    log(f"phases: Qwen3 {n_params / 1e6:.1f}M (hidden {H}, {L} layers, vocab {cfg['vocab_size']}), threads "
        f"{threads}, prefill {P}, decode batches {batch_sizes}, {args.repeats} round(s)")
    best: dict[tuple, float] = {}
    gens, peers = {}, {}
    try:
        # With a peer: real checkpoints (the same random weights for both engines), else qwen_rt's dummy weights.
        peer_types = ("F32", "BF16", "F16") + (("Q8_0",) if "fp8" in dtypes else ())
        files = llama.write_models(cfg, args.seed, workdir, converter, log, peer_types) if peer else {}
        for dtype in dtypes:  # "fp8": the bf16 checkpoint quantized at load (block-128 FP8 linears)
            src = (files["float32"] if dtype == "float32" else files["bfloat16"]) if peer else folder
            gens[dtype] = Generator(str(src), device="cpu", dtype="bfloat16" if dtype == "fp8" else dtype,
                                    quantization="fp8" if dtype == "fp8" else None,
                                    load_format="auto" if peer else "dummy",
                                    seed=args.seed, max_batch_size=max(batch_sizes), max_model_len=P + 128,
                                    num_threads=threads, enable_prefix_caching=False, progress=False)
        if peer:
            n_seq = max(batch_sizes)
            n_ctx = n_seq * ((max(P, short + 64) + 16 + 255) // 256 * 256)
            for t in peer_types:
                peers[t] = llama.Peer(files[t], threads, n_ctx, n_seq, n_batch=512)
        prompt = rng.integers(3, cfg["vocab_size"], size=P).tolist()
        shorts = rng.integers(3, cfg["vocab_size"], size=(max(batch_sizes), short)).tolist()

        def timed(gen, prompts, n):  # (wall, CPU time of the process) in seconds
            t0, c0 = time.perf_counter(), time.process_time()
            gen.generate(prompts, max_tokens=n, temperature=0.0, ignore_eos=True)
            return np.array([time.perf_counter() - t0, time.process_time() - c0])

        for dtype, gen in gens.items():  # warm-up
            timed(gen, [prompt], 1)
            timed(gen, shorts[:max(batch_sizes)], 8)
        for p in peers.values():
            p.prefill(prompt)
            p.decode(shorts, 8)
        for rnd in range(args.repeats):
            now = {}
            for dtype, gen in gens.items():
                now[(dtype, "prefill")] = timed(gen, [prompt], 1)
                for bs in batch_sizes:
                    now[(dtype, bs)] = (timed(gen, shorts[:bs], 72) - timed(gen, shorts[:bs], 8)) / 64
            for t, p in peers.items():  # llama.cpp: the same phases, alternating with qwen_rt's
                now[(t, "prefill")] = np.array(p.prefill(prompt))
                for bs in batch_sizes:
                    now[(t, bs)] = np.array(p.decode(shorts[:bs], 64))
            for k, t in now.items():
                if t[0] > 0:  # a difference of two timings: noise can make a tiny model's negative
                    best[k] = np.minimum(best.get(k, t), t)  # wall and CPU time, each the best of the rounds
            log(f"  round {rnd + 1}: " + ", ".join(f"{k[0]} {k[1]} {v[0] * 1e3:.2f} ms" for k, v in best.items()))
    finally:
        for gen in gens.values():
            gen.close()
        for p in peers.values():
            p.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    copy_bw = measure_copy_bandwidth()
    head = cfg["vocab_size"] * H
    attn_flop = 4 * L * cfg["num_attention_heads"] * cfg["head_dim"] * P * (P + 1) / 2  # q.k and p.v, causal
    prefill_flop = 2 * (linear_params - head) * P + 2 * head + attn_flop  # the LM head on the last row only
    rows = []
    for dtype in dtypes + list(peers):
        esz = {"float32": 4, "F32": 4, "fp8": 1 + 4 / 128**2, "Q8_0": 34 / 32}.get(dtype, 2)  # weight bytes
        t, cpu = best[(dtype, "prefill")]
        rows.append({"engine": "llama.cpp" if dtype in peers else "qwen_rt", "dtype": dtype, "phase": f"prefill {P}",
                     "time_ms": t * 1e3, "cpu_ms": cpu * 1e3, "tok_s": P / t, "gflop_s": prefill_flop / t / 1e9})
        for bs in batch_sizes:
            if (dtype, bs) not in best:
                log(f"{dtype} decode b{bs}: no round timed 72 tokens above 8 (the machine's noise is larger)")
                continue
            t, cpu = best[(dtype, bs)]
            step_bytes = linear_params * esz + bs * (short + 40) * L * kv_row * esz  # weights + mean KV read
            rows.append({"engine": "llama.cpp" if dtype in peers else "qwen_rt", "dtype": dtype,
                         "phase": f"decode b{bs}", "time_ms": t * 1e3, "cpu_ms": cpu * 1e3, "tok_s": bs / t,
                         "gb_s": step_bytes / t / 1e9, "mbu": step_bytes / t / copy_bw})
    _print_table(rows, file=sys.stderr)
    ratios = []
    if peers:  # qwen_rt's speed over llama.cpp's (> 1: faster), phase by phase, wall and CPU time
        # FP8 against Q8_0 for information: both 8-bit weights, not the same format.
        for ours, theirs in (("float32", "F32"), ("bfloat16", "BF16"), ("bfloat16", "F16"), ("fp8", "Q8_0")):
            if ours not in dtypes:
                continue
            for phase in ["prefill"] + batch_sizes:
                if (ours, phase) in best and (theirs, phase) in best:
                    a, b = best[(ours, phase)], best[(theirs, phase)]
                    ratios.append({"qwen_rt": ours, "llama.cpp": theirs,
                                   "phase": f"prefill {P}" if phase == "prefill" else f"decode b{phase}",
                                   "speed_ratio": round(float(b[0] / a[0]), 3),
                                   "cpu_time_ratio": round(float(b[1] / a[1]), 3)})
        _print_table(ratios, file=sys.stderr)
    log(f"copy bandwidth (one thread, read + write): {copy_bw / 1e9:.1f} GB/s; cpu_ms: CPU time of the process "
        "(with --threads 1 the measure that other processes on the machine disturb least)")
    _emit_record(_record("cpu-phases", args, {"threads": threads, "model": cfg, "rows": rows, "vs_peer": ratios,
                                              "limits": {"copy_bw": copy_bw}}), args.json)
    return 0


# ----------------------------------------------------------------------------------------------------

def run_gpu(args) -> int:
    from qwen_rt import bench_gpu
    return bench_gpu.run(args)


MODES = {"cpu": run_cpu, "gpu": run_gpu}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-rt bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", metavar="MODE")
    p = sub.add_parser("cpu", help="random ~100M Qwen3 on the CPU: transformers vs qwen_rt")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated (default 1,8)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32,bfloat16",
                   help="qwen_rt dtypes, comma-separated (--phases also takes fp8: the bf16 weights quantized at load, "
                        "timed against llama.cpp's Q8_0)")
    p.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers dtypes, comma-separated")
    p.add_argument("--hf-attn", default="sdpa,eager", help="transformers attention implementations")
    p.add_argument("--hf-cache", default="dynamic,static", help="transformers KV caches")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up; the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="measure qwen_rt only")
    p.add_argument("--skip-qwen-rt", action="store_true", help="measure transformers only")
    p.add_argument("--workdir", default=None, help="where the model is written (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--json", default=None, metavar="PATH", help="append the JSON record to PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="draw the figures into a PNG (needs matplotlib)")
    p.add_argument("--phases", action="store_true",
                   help="qwen_rt alone by phase (prefill --prefill-len, decode at --batch-sizes), random weights")
    p.add_argument("--prefill-len", type=int, default=512, help="--phases: the prefill prompt's length")
    p.add_argument("--layers", type=int, default=None, help="--phases: layers of the model (default 12)")
    p.add_argument("--vocab", type=int, default=None, help="--phases: vocabulary size (default 32768)")
    p.add_argument("--peer", default=None, choices=["llama.cpp"],
                   help="--phases: time llama.cpp (llama-cpp-python) beside qwen_rt on the same weights, converted "
                        "by llama.cpp's converter to GGUF F32/BF16/F16, and print the ratios")
    p.add_argument("--peer-converter", default=None, metavar="PATH",
                   help="llama.cpp's convert_hf_to_gguf.py (or a llama.cpp / llama-cpp-python source folder); "
                        "default $LLAMA_CPP_CONVERTER")
    from qwen_rt import bench_gpu
    bench_gpu.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["cpu"] + argv  # default mode
    parser = _build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.prompt_len < 1 or args.new_tokens < 1 or getattr(args, "repeats", 1) < 1:
        parser.error("--prompt-len, --new-tokens and --repeats must be >= 1")
    if args.plot:
        from qwen_rt.bench_plot import plotting_unavailable
        why = plotting_unavailable()
        if why:
            parser.error(f"--plot: {why}")  # before the run, not after minutes of it
    if args.mode == "cpu" and args.phases:
        return run_cpu_phases(args)
    return MODES[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
