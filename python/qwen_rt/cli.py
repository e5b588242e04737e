"""`qwen-rt` command line: generate, bench, info."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import IO, Sequence

__all__ = ["main", "print_table"]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        a = abs(v)
        if a == 0 or 0.01 <= a < 1e6:
            return f"{v:.3f}" if a < 10 else (f"{v:.2f}" if a < 1000 else f"{v:.1f}")
        return f"{v:.3g}"
    return str(v)


def print_table(rows: list[dict], file: IO[str] | None = None, columns: Sequence[str] | None = None) -> None:
    """Prints rows (dicts) as a table with aligned columns; numbers are right-aligned."""
    file = sys.stdout if file is None else file
    if not rows:
        return
    if columns is None:
        columns = []
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]
    widths = [max(len(str(c)), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(vals, align=True):
        out = []
        for i, v in enumerate(vals):
            out.append(v.rjust(widths[i]) if (align and numeric[i]) else v.ljust(widths[i]))
        return "  ".join(out).rstrip()

    print(line([str(c) for c in columns], align=False), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print(line(row), file=file)
    file.flush()


# ----------------------------------------------------------------------------------------------------
# generate

_SAMPLING_ARGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "logprobs")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt",
                       description="Generate text for one prompt ('-' reads it from stdin).")
    p.add_argument("prompt")
    p.add_argument("--model", "-m", required=True,
                   help="local folder, hub id, or packaged config name (with --load-format dummy)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="print the top-N logprobs per token")
    p.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids ('1 2 3' or '1,2,3'); the output is printed as ids too. For a "
                        "model without a tokenizer, such as a packaged config with --load-format dummy")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=False (Qwen3)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--quantization", default=None, choices=["fp8"], help="quantize a 16/32-bit checkpoint at load")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"])
    p.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES", help="bytes of the device KV pool")
    p.add_argument("--kv-offload-memory", type=int, default=None, metavar="BYTES",
                   help="host memory for a second KV tier (pinned on CUDA)")
    p.add_argument("--sparse-attention", type=int, default=None, metavar="TOKENS",
                   help="decode long contexts attending to this many tokens (runtime-scored pages)")
    p.add_argument("--kv-staging-pages", type=int, default=None, metavar="N",
                   help="device frames keeping the host pages sparse attention chose (with --kv-offload-memory)")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="K", help="MTP draft tokens a step")
    p.add_argument("--rope-scaling", default=None, metavar="JSON",
                   help='keys over config.json\'s RoPE settings, e.g. \'{"rope_type": "yarn", "factor": 4.0, '
                        '"original_max_position_embeddings": 262144}\'')
    p.set_defaults(func=_cmd_generate)


# Generator arguments the generate command passes through when given (flag name with '_' for '-').
_ENGINE_ARGS = ("max_model_len", "max_batch_size", "revision", "quantization", "kv_cache_dtype", "kv_cache_memory",
                "kv_offload_memory", "kv_staging_pages", "speculative_tokens")


def _ids_text(ids) -> str:
    return " ".join(str(t) for t in ids)


def _cmd_generate(args) -> int:
    try:
        from qwen_rt import Generator  # lazily: the native module loads here
    except ImportError as e:
        print(f"qwen-rt: error: cannot load the qwen_rt runtime ({e})", file=sys.stderr)
        return 1

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    # Prompts a model cannot take fail before it loads.
    if args.token_ids:
        if args.chat:
            raise ValueError("--chat takes a text prompt, not --token-ids")
        try:
            prompt = [int(t) for t in prompt.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--token-ids: the prompt must be integers ('1 2 3'), got {prompt[:40]!r}") from None
    if args.chat and os.path.isdir(args.model) and not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        raise ValueError(f"--chat needs a tokenizer, and {args.model} has no tokenizer.json")
    if not args.token_ids:
        from qwen_rt.model_files import packaged_name
        name = packaged_name(args.model, args.load_format)
        if name is not None:
            raise ValueError(f"{args.model!r} is a packaged config, without a tokenizer: pass the prompt as token "
                             "ids with --token-ids")
    gen_kwargs = dict(device=args.device, dtype=args.dtype, load_format=args.load_format,
                      tensor_parallel_size=args.tensor_parallel_size)
    gen_kwargs.update({k: getattr(args, k) for k in _ENGINE_ARGS if getattr(args, k) is not None})
    if args.rope_scaling is not None:
        import json
        try:
            gen_kwargs["rope_scaling"] = json.loads(args.rope_scaling)
        except json.JSONDecodeError as e:
            raise ValueError(f"--rope-scaling must be a JSON object ({e})") from None
    if args.sparse_attention is not None:
        from qwen_rt import SparseAttention
        gen_kwargs["sparse_attention"] = SparseAttention(budget_tokens=args.sparse_attention)
    sampling = {k: getattr(args, k) for k in _SAMPLING_ARGS if getattr(args, k) is not None}
    if args.stop:
        sampling["stop"] = list(args.stop)
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    # Bad sampling flags fail before the model loads (the vocabulary-bound checks wait for the model).
    from qwen_rt.sampling import INT32_MAX, SamplingParams
    from qwen_rt.generator import MAX_LOGPROBS
    SamplingParams().replace(**sampling).resolved({}).validate(INT32_MAX, MAX_LOGPROBS)

    t_load = time.perf_counter()
    with Generator(args.model, **gen_kwargs) as gen:
        load_s = time.perf_counter() - t_load
        if args.chat:
            extra = {"enable_thinking": False} if args.no_thinking else {}
            prompt = gen.chat_prompt([{"role": "user", "content": prompt}], **extra)
        t0 = time.perf_counter()
        t_first = None
        pieces: list[str] = []
        req = gen.submit(prompt, **sampling)
        try:
            for delta in req:
                if t_first is None and delta.token_ids:
                    t_first = time.perf_counter()
                if delta.text:
                    pieces.append(delta.text)
                if args.stream and delta.token_ids:
                    sys.stdout.write(_ids_text(delta.token_ids) + " " if args.token_ids else delta.text or "")
                    sys.stdout.flush()
        except KeyboardInterrupt:
            req.cancel()
            print("\n[cancelled]", file=sys.stderr)
        comp = req.result()
        t_end = time.perf_counter()
        tok = gen.tokenizer

    text = _ids_text(comp.token_ids) if args.token_ids else comp.text if comp.text is not None else "".join(pieces)
    if args.stream:
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text + "\n")
    sys.stdout.flush()

    if args.logprobs and comp.logprobs:
        rows = []
        for tid, lp in zip(comp.token_ids, comp.logprobs):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: args.logprobs]
            rows.append({
                "token": repr(tok.decode([tid], skip_special_tokens=False)) if tok else "",
                "id": tid,
                "logprob": float(lp.get(tid, float("nan"))),
                "top": " ".join(f"{i}:{v:.2f}" for i, v in top),
            })
        print_table(rows, file=sys.stderr)

    n_out = len(comp.token_ids)
    ttft = (t_first - t0) if t_first is not None else None
    decode_tps = ((n_out - 1) / (t_end - t_first)) if (t_first is not None and n_out > 1 and t_end > t_first) else None
    stats = [
        {"metric": "prompt tokens", "value": len(comp.prompt_token_ids)},
        {"metric": "output tokens", "value": n_out},
        {"metric": "finish reason", "value": comp.finish_reason},
        {"metric": "load time (s)", "value": load_s},
        {"metric": "time to first token (s)", "value": ttft},
        {"metric": "total time (s)", "value": t_end - t0},
        {"metric": "output tokens/s", "value": n_out / (t_end - t0) if t_end > t0 else None},
        {"metric": "decode tokens/s", "value": decode_tps},
    ]
    print_table(stats, file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------------
# info

def _cmd_info(args) -> int:
    import importlib
    import platform

    from qwen_rt import model_files

    rows = []
    try:
        from importlib.metadata import version as _dist_version
        ver = _dist_version("qwen_rt")
    except Exception:
        ver = None
    try:
        pkg = importlib.import_module("qwen_rt")
        ver = getattr(pkg, "__version__", None) or ver
    except Exception as e:  # the package imports the native module; say why it failed
        rows.append({"item": "import qwen_rt", "value": f"failed: {type(e).__name__}: {e}"})
    rows.insert(0, {"item": "version", "value": ver or "unknown"})
    rows.append({"item": "python", "value": platform.python_version()})
    try:
        core = importlib.import_module("qwen_rt._core")
    except Exception as e:
        rows.append({"item": "native module", "value": f"not available ({type(e).__name__}: {e})"})
        core = None
    if core is not None:
        rows.append({"item": "native module", "value": getattr(core, "__file__", "built-in")})
        # The CUDA backend is a plugin (_cuda_backend.so) loaded at run time; the reason says why no GPU is usable:
        # the build has no plugin, the plugin cannot load (a library it needs), or the driver sees no device.
        plugin_err = str(core.cuda_plugin_error())
        rows.append({"item": "CUDA backend", "value": "yes" if not plugin_err else f"no: {plugin_err}"})
        rows.append({"item": "CUDA devices", "value": int(core.cuda_device_count())})
        reason = str(core.cuda_unavailable_reason())
        if reason and not plugin_err:
            rows.append({"item": "CUDA unavailable", "value": reason})
    rows.append({"item": "packaged configs", "value": ", ".join(model_files.packaged_configs())})
    print_table(rows, file=sys.stdout)
    return 0


# ----------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """Bad flags are bad input like any other: one `qwen-rt: error:` line and exit status 1 (main)."""

    def error(self, message):
        raise ValueError(f"{message} (see `{self.prog} -h`)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qwen-rt", description="Fast Qwen inference (qwen_rt).")
    sub = parser.add_subparsers(dest="command", metavar="{generate,bench,info}")
    _add_generate(sub)
    sub.add_parser("bench", help="benchmarks (see `qwen-rt bench -h`)", add_help=False)
    pi = sub.add_parser("info", help="version, native build, devices, packaged configs")
    pi.set_defaults(func=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from qwen_rt import bench
        return bench.main(argv[1:])
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, MemoryError) as e:  # bad input, or what the runtime could not do
        print(f"qwen-rt: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
