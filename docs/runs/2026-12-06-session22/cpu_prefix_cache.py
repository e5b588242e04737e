import time, numpy as np, qwen_rt, json
rng = np.random.default_rng(0)
rows = []
for caching in (True, False):
    g = qwen_rt.Generator("qwen3-0.6b", load_format="dummy", device="cpu", dtype="bfloat16", max_batch_size=16,
                          max_model_len=1024, enable_prefix_caching=caching, progress=False)
    V = g.config["vocab_size"]
    g.generate([rng.integers(10, V - 10, 32).tolist()], max_tokens=4, ignore_eos=True)
    shared = rng.integers(10, V - 10, 512).tolist()
    ps = [shared + rng.integers(10, V - 10, 32).tolist() for _ in range(16)]
    t = time.perf_counter(); outs = g.generate(ps, max_tokens=16, ignore_eos=True, temperature=0); el = time.perf_counter() - t
    rows.append(dict(prefix_caching=caching, seconds=round(el, 2), output_tok_s=round(16 * 16 / el, 1),
                     cached_tokens=g.stats()["cached_tokens"]))
    print(rows[-1], flush=True)
    g.close()
