"""asyncio: several coroutines share one Generator; the engine batches their requests.

    python examples/async_generate.py --model Qwen/Qwen3-0.6B
"""
import argparse
import asyncio

import qwen_rt


async def stream_one(gen: qwen_rt.Generator, prompt: str, max_tokens: int) -> str:
    pieces = []
    async for delta in gen.astream(prompt, max_tokens=max_tokens, temperature=0.8, seed=2):
        pieces.append(delta.text)
    return "".join(pieces)


async def main(args) -> None:
    with qwen_rt.Generator(args.model, device=args.device) as gen:
        prompts = ["Tell me about rivers.", "Name three colours.", "What is 2 + 2?"]
        streamed, batch = await asyncio.gather(
            stream_one(gen, prompts[0], args.max_tokens),
            gen.agenerate(prompts[1:], max_tokens=args.max_tokens, temperature=0.8, seed=3))
        print(f"{prompts[0]!r} (streamed) -> {streamed!r}")
        for prompt, out in zip(prompts[1:], batch):
            print(f"{prompt!r} -> {out.text!r} ({out.finish_reason})")


p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="local folder or Hub id (with a tokenizer)")
p.add_argument("--device", default="auto")
p.add_argument("--max-tokens", type=int, default=32)
asyncio.run(main(p.parse_args()))
