"""Where a decode step's (or a prefill's) GPU time goes: per-kernel device time of qwen_rt decode steps (dummy weights,
real config), taken with torch.profiler (CUPTI sees the plugin's kernels too): a call of N decode steps
less a call of the prefill alone. CUDA graphs are off so every kernel is recorded by name; the step time
with graphs on is printed beside it.

    python tools/profile_decode.py --model qwen3-8b --batch 1 [--tokens 32] [--out table.txt] [--quantization fp8]
        [--temperature 0.8 --top-p 0.95]   (the offline bench's sampling; default greedy)
        [--prompt-len 4096]   (the whole prefill is one step, so that every decode step has the full batch)
        [--tokens 0]   (the prefill alone: where a prompt's time goes, e.g. --model qwen3.8-27b --prompt-len 8192)

Run it with QWEN_RT_PDL=0: chained launches start a kernel before the one ahead of it ends, and the profiler counts
that wait in the kernel's time (session 28's FP8 profiles: 34.6 ms of kernels in a 12.6 ms step).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import qwen_rt
from qwen_rt.bench_gpu import decode_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--quantization", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    lines = []
    for graphs in (True, False) if a.tokens else (False,):
        with qwen_rt.Generator(a.model, device="cuda", dtype="bfloat16", load_format="dummy", progress=False,
                               max_batch_size=max(a.batch, 8), max_model_len=a.prompt_len + a.tokens + 16,
                               max_num_batched_tokens=max(2048, a.batch * a.prompt_len), cuda_graphs=graphs,
                               quantization=a.quantization) as g:
            V = g.config["vocab_size"]
            prompts = [rng.integers(10, V - 10, size=a.prompt_len).tolist() for _ in range(a.batch)]
            sampling = dict(temperature=a.temperature, top_p=a.top_p)
            if a.tokens:
                ms = decode_step(g, prompts, a.tokens, **sampling)[0] * 1e3
                lines.append(f"{a.model} batch {a.batch}: decode step {ms:.3f} ms with cuda_graphs={graphs}")
            if graphs:
                continue
            sampling["ignore_eos"] = True
            # Per kernel: device time of a call with a.tokens decode steps less that of the prefill alone (with
            # --tokens 0: the prefill's own).
            rows, prefill_us = {}, 0.0
            if not a.tokens:
                g.generate(prompts, max_tokens=1, **sampling)  # warm-up: workspaces, GEMM heuristics
            for steps, sign in ((a.tokens, 1), (0, -1)) if a.tokens else ((0, 1),):
                torch.cuda.synchronize()
                # acc_events: keep every cycle's events (without it torch 2.11 kept only the last part of an 8k
                # prefill: 34 ms of kernels, session 31).
                with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
                    g.generate(prompts, max_tokens=steps + 1, **sampling)
                    torch.cuda.synchronize()
                for e in prof.events():
                    if e.device_type != torch.autograd.DeviceType.CUDA:
                        continue
                    r = rows.setdefault(e.name[:140], [0, 0.0])
                    r[0] += sign
                    us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                    r[1] += sign * us
                    prefill_us += us if sign < 0 else 0.0
            if a.tokens:
                lines.append(f"prefill of {a.batch} x {a.prompt_len} tokens (+1 sampled): {prefill_us / 1e3:.2f} ms of "
                             "kernels")
    total = sum(v[1] for v in rows.values())
    steps = max(a.tokens, 1)
    if a.tokens:
        lines.append(f"kernel time of {a.tokens} decode steps (prefill subtracted): {total / 1e3:.2f} ms, "
                     f"{total / 1e3 / a.tokens:.3f} ms per step")
    else:
        lines.append(f"kernel time of the prefill: {total / 1e3:.2f} ms")
    lines.append(f"{'us/step' if a.tokens else 'us':>9} {'share':>6} {'calls':>6}  kernel")
    for name, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:30]:
        lines.append(f"{us / steps:9.1f} {us / total:6.1%} {n:6d}  {name}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
