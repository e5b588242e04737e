"""Bisects a host-tier (kv_offload_memory) mismatch on the GPU: the same prompts with and without the host tier,
under variants (overlap off, CUDA graphs off, prefill chunk sizes), printing which variants differ.
  python tools/offload_bisect.py            (needs a GPU; builds the tests' tiny model)"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    if len(sys.argv) > 1:  # a variant in a child process (QWEN_RT_OVERLAP is read once per process)
        return child(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
    import models as M
    folder = Path(tempfile.mkdtemp()) / "m"
    M.build_model(folder, "qwen3_hd64_gqa4")
    for sparse in ("1", "0"):
        for overlap in ("1", "0"):
            for graphs in ("1", "0"):
                chunk = 64
                env = dict(os.environ, QWEN_RT_OVERLAP=overlap, QWEN_RT_PROGRESS="0")
                r = subprocess.run([sys.executable, __file__, str(folder), graphs, str(chunk), sparse], env=env,
                                   capture_output=True, text=True)
                print(f"sparse {sparse} overlap {overlap} graphs {graphs} chunk {chunk}: {r.stdout.strip()} "
                      f"{r.stderr[-300:]}", flush=True)
    return 0


def child(folder: Path, graphs: str, chunk: int, sparse: bool) -> int:
    import models as M
    import qwen_rt
    prompts = M.pick_prompts(folder, seed=15, lengths=[300, 120], max_new=10)
    sa = qwen_rt.SparseAttention(budget_tokens=96, sink_tokens=16, window_tokens=32) if sparse else None
    base = dict(device="cuda", dtype="float32", page_size=16, max_num_batched_tokens=chunk, max_batch_size=2,
                max_model_len=400, cuda_graphs=graphs == "1", sparse_attention=sa)
    ref = qwen_rt.Generator(str(folder), **base)
    want = [c.token_ids for c in ref.generate(prompts, max_tokens=10, temperature=0, ignore_eos=True)]
    want_alone = [ref.generate([p], max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids for p in prompts]
    ref.close()
    reserve = chunk // 16 + 2 * 2  # a step's pages (Engine::Impl::step_pages)
    rows = (reserve + 2 + 4) * 17 if sparse else (reserve + 2) * 16  # the host pages' summaries: 4 pages of 17
    gen = qwen_rt.Generator(str(folder), kv_cache_memory=M.kv_bytes(folder, 1, 1) * rows,
                            kv_offload_memory=M.kv_bytes(folder, 60, 16), **base)
    got = [c.token_ids for c in gen.generate(prompts, max_tokens=10, temperature=0, ignore_eos=True)]
    # One at a time too.
    alone = [gen.generate([p], max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids for p in prompts]
    st = gen.stats()
    print("same" if got == want else f"DIFF batch {[g == w for g, w in zip(got, want)]}",
          "alone", [a == w for a, w in zip(alone, want_alone)], "ref batch vs alone",
          [a == w for a, w in zip(want_alone, want)], "device_pages", st["device_pages"], "to_host",
          st["kv_bytes_to_host"], "to_device", st["kv_bytes_to_device"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
