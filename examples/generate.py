"""Generate text for a batch of prompts (one call; the engine batches them).

    python examples/generate.py --model Qwen/Qwen3-0.6B
    python examples/generate.py --model qwen3-0.6b --load-format dummy    # random weights, no download: token ids
"""
import argparse

import qwen_rt

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="local folder, Hub id, or packaged config name")
p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
p.add_argument("--device", default="auto")
p.add_argument("--max-tokens", type=int, default=32)
args = p.parse_args()

with qwen_rt.Generator(args.model, device=args.device, load_format=args.load_format) as gen:
    # A model without a tokenizer (random weights from a packaged config) takes prompts as token ids.
    prompts = ["The capital of France is", "Write a haiku about the sea."] if gen.tokenizer else [[1, 2, 3], [4, 5]]
    outs = gen.generate(prompts, max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=1)
    for prompt, out in zip(prompts, outs):
        print(f"{prompt!r} -> {out.text if gen.tokenizer else out.token_ids!r} ({out.finish_reason}, "
              f"{len(out.token_ids)} tokens)")
