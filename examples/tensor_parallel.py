"""Tensor parallelism in one process: the model split over ranks (GPUs, or threads on the CPU); greedy tokens
equal those of one rank. No launcher, no __main__ guard needed.

    python examples/tensor_parallel.py --model Qwen/Qwen3-0.6B --tp 2 --device cpu
    python examples/tensor_parallel.py --model qwen3-0.6b --load-format dummy --tp 2 --device cpu   # no download
"""
import argparse

import qwen_rt

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="local folder, Hub id, or packaged config name")
p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
p.add_argument("--device", default="cpu", help="cpu (threads), cuda (one GPU per rank)")
p.add_argument("--tp", type=int, default=2, help="ranks")
p.add_argument("--max-tokens", type=int, default=16)
args = p.parse_args()

tokens = {}
for ranks in (1, args.tp):
    # float32: exact arithmetic, so the split sums cannot flip a near-tie between two tokens.
    with qwen_rt.Generator(args.model, device=args.device, load_format=args.load_format, dtype="float32",
                           tensor_parallel_size=ranks, max_model_len=256, seed=0) as gen:
        prompt = "The quick brown fox" if gen.tokenizer else [11, 12, 13, 14]
        (out,) = gen.generate([prompt], max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        tokens[ranks] = out.token_ids
        print(f"tensor_parallel_size={ranks}: {out.token_ids}")
print("same tokens" if tokens[1] == tokens[args.tp] else "the tokens differ")
