"""llama.cpp beside qwen_rt on the CPU (`qwen-rt bench cpu --phases --peer llama.cpp`): the bench's random Qwen3
saved by transformers (float32 and bfloat16), converted to GGUF F32 / BF16 / F16 by llama.cpp's own converter, and
timed through llama-cpp-python's low-level API by the phases qwen_rt is timed by: one prefill of a prompt from an
empty cache, and decode steps of 1 or more sequences after a short prompt each (the batch's tokens in one
llama_decode, one sequence id each).

Needs llama-cpp-python (its build has llama.cpp's CPU kernels for this machine), torch and transformers (to write the
checkpoint), and the converter: convert_hf_to_gguf.py of a llama.cpp checkout, or of llama-cpp-python's source
(vendor/llama.cpp), with its gguf-py beside it. The converter refuses a BPE pre-tokenizer it does not know (the
bench's tokenizer is a small one trained here); the bench feeds token ids, so it names it "qwen2" for the converter.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

# Runs the converter with get_vocab_base_pre answering "qwen2" (the bench's tokenizer is no known one; the timing
# feeds ids). argv: converter path, then the converter's own arguments.
_CONVERT = """
import runpy, sys
from pathlib import Path
conv = Path(sys.argv[1])
sys.path[:0] = [str(conv.parent), str(conv.parent / "gguf-py")]
sys.argv = [str(conv)] + sys.argv[2:]
mod = runpy.run_path(str(conv), run_name="convert_hf_to_gguf")
try:  # the converter as a package (conversion/), or as one file
    from conversion.base import TextModel
except ImportError:
    TextModel = mod["TextModel"]
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
mod["main"]()
"""


def missing() -> str | None:
    """Why the peer cannot run here, or None."""
    for mod in ("llama_cpp", "torch", "transformers", "sentencepiece"):  # sentencepiece: the converter's
        try:
            __import__(mod)
        except ImportError as e:
            return f"--peer llama.cpp needs {mod} ({e}); pip install llama-cpp-python torch transformers sentencepiece"
    return None


def find_converter(given: str | None) -> Path:
    """convert_hf_to_gguf.py: given (a file, or a llama.cpp / llama-cpp-python source folder), else
    $LLAMA_CPP_CONVERTER."""
    p = given or os.environ.get("LLAMA_CPP_CONVERTER")
    if not p:
        raise ValueError("--peer llama.cpp needs llama.cpp's converter: --peer-converter PATH (convert_hf_to_gguf.py "
                         "of a llama.cpp checkout, or llama-cpp-python's source folder) or $LLAMA_CPP_CONVERTER")
    path = Path(p)
    for cand in (path, path / "convert_hf_to_gguf.py", path / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"):
        if cand.is_file() and cand.name == "convert_hf_to_gguf.py":
            return cand
    raise ValueError(f"--peer-converter {p}: no convert_hf_to_gguf.py there")


def _write_tokenizer(folder: Path, vocab: int) -> None:
    """A small byte-level BPE (trained here on a few sentences): the converter wants a tokenizer; it pads the
    vocabulary to the model's with placeholder tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = ["the", "model", "runs", "fast", "on", "every", "core", "of", "this", "machine", "tokens", "decode"]
    text = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=min(vocab, 400), special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", '
                                                  '"eos_token": "<|endoftext|>"}')


def write_models(cfg: dict, seed: int, workdir: Path, converter: Path, log, types) -> dict[str, Path]:
    """The random Qwen3 of cfg (torch seed) as transformers checkpoints {"float32", "bfloat16"} and GGUF files of
    the given types among "F32", "BF16", "F16", "Q8_0" (BF16 from the bfloat16 checkpoint, the others from the
    float32 one)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    keys = Qwen3Config().to_dict().keys()
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in cfg.items() if k in keys})).eval()
    out: dict[str, Path] = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        folder = workdir / f"hf-{name}"
        model.to(dt).save_pretrained(folder, safe_serialization=True)
        _write_tokenizer(folder, cfg["vocab_size"])
        out[name] = folder
    for t in types:
        src = "bfloat16" if t == "BF16" else "float32"
        dst = workdir / f"m-{t}.gguf"
        log(f"  converting to GGUF {t} ({converter})")
        r = subprocess.run([sys.executable, "-c", _CONVERT, str(converter), str(out[src]), "--outtype", t.lower(),
                            "--outfile", str(dst)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"llama.cpp's converter failed on {out[src]} ({t}):\n{r.stderr[-2000:]}")
        out[t] = dst
    return out


class Peer:
    """One GGUF model in llama.cpp with a context for max_seqs sequences of n_ctx tokens in all."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, max_seqs: int, n_batch: int):
        import llama_cpp as L
        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        if gguf.stem.endswith("Q8_0"):
            # Q8_0 through the AMX repacked buffers crashed llama-cpp-python 0.3.36 (SIGSEGV in the first decode on
            # a Sapphire Rapids VM): the plain CPU buffers instead.
            mp.use_extra_bufts = False
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, max_seqs
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {gguf}")
        self.batch = L.llama_batch_init(n_batch, 0, max_seqs)
        self.n_batch = n_batch

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, entries) -> None:
        """entries: (token, position, sequence, wants_logits) in one llama_decode."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(tok), pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def prefill(self, prompt) -> tuple[float, float]:
        """(wall, CPU) seconds of one prompt from an empty cache, its last row's logits computed."""
        self._clear()
        w, c = time.perf_counter(), time.process_time()
        for s in range(0, len(prompt), self.n_batch):
            part = prompt[s:s + self.n_batch]
            self._decode([(t, s + i, 0, s + i == len(prompt) - 1) for i, t in enumerate(part)])
        self.L.llama_synchronize(self.ctx)
        return time.perf_counter() - w, time.process_time() - c

    def decode(self, shorts, steps: int) -> tuple[float, float]:
        """(wall, CPU) seconds per step of `steps` steps, each a token of every sequence (after its short prompt)."""
        self._clear()
        n = len(shorts[0])
        self._decode([(t, i, s, i == n - 1) for s, p in enumerate(shorts) for i, t in enumerate(p)])
        w, c = time.perf_counter(), time.process_time()
        for k in range(steps):
            self._decode([(p[(k * 7 + s) % n], n + k, s, True) for s, p in enumerate(shorts)])
        self.L.llama_synchronize(self.ctx)
        return (time.perf_counter() - w) / steps, (time.process_time() - c) / steps
