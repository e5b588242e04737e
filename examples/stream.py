"""Print a reply as it is generated; Ctrl-C (or leaving the loop) cancels the request.

    python examples/stream.py --model Qwen/Qwen3-0.6B "Once upon a time"
"""
import argparse
from contextlib import closing

import qwen_rt

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("prompt", nargs="?", default="Once upon a time")
p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="local folder or Hub id (with a tokenizer)")
p.add_argument("--device", default="auto")
p.add_argument("--max-tokens", type=int, default=64)
args = p.parse_args()

with qwen_rt.Generator(args.model, device=args.device) as gen:
    # closing(): the request is cancelled as soon as the loop is left, not when the iterator is collected.
    with closing(gen.stream(args.prompt, max_tokens=args.max_tokens, temperature=0.8, seed=1)) as deltas:
        for delta in deltas:
            print(delta.text, end="", flush=True)
            if delta.finish_reason:
                print(f"\n[{delta.finish_reason}]")
