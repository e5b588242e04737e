"""Issue 35's side-by-side with llama.cpp, as run by hand on 2026-12-07 (not part of the bench yet).

1. `python llama_cpp_side_by_side.py models DIR CONVERTER`: issue 35's random Qwen3 (seed 0) saved by transformers
   in float32 and bfloat16 with the tests' BPE tokenizer, converted by llama.cpp's own `convert_hf_to_gguf.py`
   (CONVERTER; the llama-cpp-python sdist carries it under vendor/llama.cpp) to DIR/m-{f32,bf16,f16}.gguf. That
   converter refuses a BPE pre-tokenizer it does not know (the tests' tokenizer): the copy used here returned
   "qwen2" there instead of raising (the timing feeds token ids, so the pre-tokenizer plays no part).
2. `python llama_cpp_side_by_side.py time DIR THREADS`: llama-cpp-python on each GGUF: a 512-token prompt from a
   reset context, then 64 single-token steps after a 16-token prompt; best of 3 rounds, wall and CPU time.
qwen_rt's side: `qwen-rt bench cpu --phases --layers 10 --vocab 32000 --threads THREADS`, alternated with step 2.
"""
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def models(out: Path, converter: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qwen_rt.bench import BENCH_MODEL_CPU
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from models import write_tokenizer

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**dict(BENCH_MODEL_CPU, num_hidden_layers=10, vocab_size=32000))).eval()
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model.to(dt).save_pretrained(out / f"hf-{name}", safe_serialization=True)
        write_tokenizer(out / f"hf-{name}")
    gguf_py = str(Path(converter).parent / "gguf-py")
    for src, t in (("float32", "f32"), ("bfloat16", "bf16"), ("float32", "f16")):
        subprocess.run([sys.executable, converter, str(out / f"hf-{src}"), "--outtype", t,
                        "--outfile", str(out / f"m-{t}.gguf")], check=True, env={"PYTHONPATH": gguf_py})


def time_llama(out: Path, threads: int) -> None:
    from llama_cpp import Llama

    prompt = np.random.default_rng(0).integers(3, 32000, 512).tolist()
    for t in ("f32", "bf16", "f16"):
        llm = Llama(model_path=str(out / f"m-{t}.gguf"), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                    n_threads_batch=threads, verbose=False)
        best = {}
        for _ in range(3):
            llm.reset()
            w0, c0 = time.perf_counter(), time.process_time()
            llm.eval(prompt)
            pre = (time.perf_counter() - w0, time.process_time() - c0)
            llm.reset()
            llm.eval(prompt[:16])
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(64):
                llm.eval([int(prompt[16 + i])])
            dec = ((time.perf_counter() - w0) / 64, (time.process_time() - c0) / 64)
            for k, v in (("prefill", pre), ("b1", dec)):
                best[k] = tuple(min(a, b) for a, b in zip(best.get(k, v), v))
        print(f"llama.cpp {t} threads {threads}: prefill 512 {best['prefill'][0] * 1e3:.1f} ms wall "
              f"{best['prefill'][1] * 1e3:.1f} ms CPU ({512 / best['prefill'][0]:.1f} tok/s); decode b1 "
              f"{best['b1'][0] * 1e3:.2f} ms wall {best['b1'][1] * 1e3:.2f} ms CPU ({1 / best['b1'][0]:.1f} tok/s)",
              flush=True)
        del llm


if __name__ == "__main__":
    if sys.argv[1] == "models":
        models(Path(sys.argv[2]), sys.argv[3])
    else:
        time_llama(Path(sys.argv[2]), int(sys.argv[3]))
