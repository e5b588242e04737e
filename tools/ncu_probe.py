"""Workloads for Nsight Compute on the GPU machine (dummy weights, CUDA graphs off so that every
kernel launch is visible to ncu):

    ncu -k regex:attn_tile_kernel --launch-skip 40 --launch-count 1 --set full python3 tools/ncu_probe.py prefill
    ncu -k regex:attn_decode_kernel --launch-skip 800 --launch-count 1 --set full python3 tools/ncu_probe.py decode [batch]
    ncu --clock-control none -k regex:gemv_fp8 --launch-skip 600 --launch-count 6 --set full \
        python3 tools/ncu_probe.py fp8decode [batch]

prefill: two 8k-token prompts, one at a time (the tile kernel of the second prompt's layers);
decode: `batch` (default 512) prompts of 128 tokens, 40 new tokens each (at batch 512, launch 800 and later are
full decode steps; a smaller batch's prompts fit one prefill step, and every later launch is a decode step);
fp8decode: Qwen3.8-27B with FP8 weights (quantized at load), `batch` (default 4) prompts of 128 tokens, 16 new
tokens each (a decode step's layers run 4 FP8 linears each: q|k|v or q|k|v|z, o or out, gate|up, down).
"""
import sys

import numpy as np

import qwen_rt


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "decode"
    if mode not in ("prefill", "decode", "fp8decode"):
        raise SystemExit("usage: ncu_probe.py prefill|decode|fp8decode [batch]")
    rng = np.random.default_rng(0)
    kw = dict(device="cuda", dtype="bfloat16", load_format="dummy", progress=False, cuda_graphs=False)
    if mode == "prefill":
        with qwen_rt.Generator("qwen3-8b", max_batch_size=4, max_model_len=8200, max_num_batched_tokens=8192, **kw) as g:
            V = g.config["vocab_size"]
            for _ in range(2):
                g.generate([rng.integers(10, V - 10, size=8192).tolist()], max_tokens=1)
    elif mode == "fp8decode":
        batch = int(sys.argv[2]) if len(sys.argv) > 2 else 4
        with qwen_rt.Generator("qwen3.8-27b", quantization="fp8", max_batch_size=max(batch, 8), max_model_len=300,
                               **kw) as g:
            V = g.config["vocab_size"]
            g.generate([rng.integers(10, V - 10, size=128).tolist() for _ in range(batch)], max_tokens=16,
                       ignore_eos=True)
    else:
        batch = int(sys.argv[2]) if len(sys.argv) > 2 else 512
        with qwen_rt.Generator("qwen3-8b", max_batch_size=batch, max_model_len=300, **kw) as g:
            V = g.config["vocab_size"]
            g.generate([rng.integers(10, V - 10, size=128).tolist() for _ in range(batch)], max_tokens=40,
                       ignore_eos=True)


if __name__ == "__main__":
    main()
