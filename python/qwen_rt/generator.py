"""Generator: the user's handle on a model running in the native engine."""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import numbers
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Iterable, Iterator

from . import _core
from .config import FLOAT_DTYPES, MULTIMODAL_PREFIX, native_config, config_dtype, with_rope_scaling
from .model_files import resolve, same_tensor, text_config
from .sampling import INT32_MAX, Completion, Delta, SamplingParams, is_int
from .tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

__all__ = ["Generator", "GeneratorClosed", "Request", "SparseAttention"]


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """Sparse decode for long contexts (runtime-scored page selection, as Quest): a request that decodes with more
    than budget_tokens of context attends, per attention layer and KV head, to its first sink_tokens, its last
    window_tokens and the pages (page_size tokens) whose keys' per-channel min/max bound q . k highest, budget_tokens
    in all. Each is rounded up to whole pages. Shorter contexts attend to every token (the same result as without)."""
    budget_tokens: int = 4096
    sink_tokens: int = 64
    window_tokens: int = 512

    def __post_init__(self):
        for name in ("budget_tokens", "sink_tokens", "window_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"SparseAttention.{name} must be an int, got {type(v).__name__}")
            if not 0 <= v <= INT32_MAX:
                raise ValueError(f"SparseAttention.{name} must be in [0, {INT32_MAX}], got {v}")
        if self.budget_tokens < 1:
            raise ValueError("SparseAttention.budget_tokens must be >= 1")


class GeneratorClosed(RuntimeError):
    """A call on a Generator that was closed before or during it (close(), or leaving its `with`)."""


MAX_LOGPROBS = 20  # the default bound on a request's top logprobs (vLLM's too)
_POLL_S = 0.2  # wait slice: short enough for Ctrl-C to be seen
MAX_THREADS = 1024  # num_threads' bound (a thread per core; more only slows the CPU backend)

# Every open Generator, and how many threads are inside one of their native calls (the GIL released).
_open_generators: "weakref.WeakSet[Generator]" = weakref.WeakSet()
_native_calls_lock = threading.RLock()  # reentrant: a Request.__del__ (GC) may run inside it
_native_calls = 0


def _after_fork_in_child() -> None:
    """The child has none of the parent's threads: none is inside a native call, none holds the counter's lock."""
    global _native_calls_lock, _native_calls
    _native_calls_lock = threading.RLock()
    _native_calls = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_at_exit() -> None:
    """Before the interpreter finalizes: a daemon thread still inside a native wait would be ended there when it
    takes the GIL back, which aborts the process. Every Generator is closed (their waits return), then the exit
    waits, 10 s at most, until no thread is inside a native call."""
    for g in list(_open_generators):
        try:
            g.close()
        except Exception:
            pass
    deadline = time.monotonic() + 10.0
    while _native_calls and time.monotonic() < deadline:
        time.sleep(0.002)


def _parse_device(device) -> tuple[str, int]:
    if not isinstance(device, str):
        raise TypeError(f"device must be a str, got {type(device).__name__}")
    d = device.strip().lower()
    if d == "auto":
        return ("cuda", 0) if _core.cuda_device_count() > 0 else ("cpu", 0)
    if d == "cpu":
        return "cpu", 0
    if d == "cuda":
        return "cuda", 0
    if d.startswith("cuda:") and d[5:].isdigit() and int(d[5:]) <= INT32_MAX:
        return "cuda", int(d[5:])
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _resolve_dtypes(device: str, dtype, stored: str) -> tuple[str, str]:
    """(weight dtype, activation dtype) for a device and the user's dtype."""
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, got {type(dtype).__name__}")
    if dtype != "auto" and dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    if device == "cpu":  # the CPU computes in float32; weights stay as stored unless told otherwise
        return (stored if dtype == "auto" else dtype), "float32"
    w = ("bfloat16" if stored == "float32" else stored) if dtype == "auto" else dtype
    return w, w


_SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _stored_dtype(tensors: dict, from_config: str) -> str:
    """The checkpoint's weight dtype: that of its embedding as stored (config.json's dtype may be missing or
    wrong), else config.json's."""
    t = tensors.get("model.embed_tokens.weight")
    return _SAFETENSORS_FLOATS.get(t.dtype, from_config) if t is not None else from_config


class _Progress:
    """Progress bar for long native steps (tqdm when available)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=total, desc=what, unit="layer", leave=False)
            except ImportError:
                self.bar = False
        if self.bar:
            self.bar.n = done
            self.bar.refresh()
        elif done == total or done % max(1, total // 10) == 0:
            print(f"{what}: {done}/{total}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar:
            self.bar.close()


class Request:
    """One submitted request. Iterate for Delta objects, or call result(); cancel() stops it."""

    def __init__(self, gen: "Generator", rid: int, prompt_ids: list[int], params: SamplingParams):
        self._gen = gen
        self._rid = rid
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache gave (known once the request has produced a token)
        self._detok = IncrementalDetokenizer(gen.tokenizer) if gen.tokenizer is not None else None
        stops = params.stop_strings()
        self._stop = StopMatcher(stops) if stops else None
        # Held around every engine wait on this request: a consumer (result, iteration) and cancel() from another
        # thread (an asyncio task's cancellation, a close) take its outputs in turn, never both at once.
        self._lock = threading.RLock()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _poll(self, timeout: float, until_finished: bool = False) -> None:
        """Takes what the engine produced within timeout into the request.
        until_finished: wait for the end of the request rather than for each token."""
        with self._lock:
            if self.finished:
                return
            try:
                out = self._gen._engine_call("wait", self._rid, timeout, until_finished)
            except GeneratorClosed:
                self._end_cancelled()  # the Generator was closed under it: it ends with what it produced
                return
            self._take(out)

    def _take(self, out) -> None:
        """Adds one engine output (tokens, logprobs, maybe the end) to the request: token_ids, text and logprobs
        always grow together. Call with the lock held."""
        if out.error:
            self.finish_reason = "error"
            raise RuntimeError(out.error)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        tokens = list(out.tokens)
        reason = out.finish_reason
        if not tokens and reason is None:
            return
        if self.logprobs is not None:
            n = out.top_n
            for i, t in enumerate(tokens):
                d = {int(out.top_ids[i * n + j]): float(out.top_logprobs[i * n + j]) for j in range(n)}
                d[int(t)] = float(out.logprobs[i])
                self.logprobs.append(d)
        # The stop token itself (eos / stop_token_ids) is kept in token_ids but not in the text.
        n_text = len(tokens) - 1 if reason == "stop" and tokens else len(tokens)
        text = ""
        stopped = False
        kept = len(tokens)
        if self._stop is None:
            text = self._detok.push(tokens[:n_text]) if self._detok else ""
            if reason is not None and self._detok:
                text += self._detok.flush()
        else:  # token by token, so the request ends at the token that completes a stop string
            for i in range(n_text):
                armed = len(self.token_ids) + i + 1 >= self.params.min_tokens  # stop strings wait for min_tokens
                piece, stopped = self._stop.feed(self._detok.push([tokens[i]]) if self._detok else "", armed)
                text += piece
                if stopped:
                    kept = i + 1
                    break
            if not stopped and reason is not None:
                piece, stopped = self._held_text(len(self.token_ids) + len(tokens) >= self.params.min_tokens)
                text += piece
        tokens = tokens[:kept]
        if self.logprobs is not None and kept < len(out.tokens):
            del self.logprobs[len(self.token_ids) + kept:]
        self.token_ids.extend(tokens)
        self.text += text
        if stopped and reason is None:  # a stop string: end the request in the engine now
            reason = "stop"
            self._gen._engine_call("cancel", self._rid)
            self._drain()
        elif stopped:
            reason = "stop"
        self.finish_reason = reason

    def _drain(self):
        while True:
            out = self._gen._engine_call("wait", self._rid, _POLL_S)
            if out.finish_reason is not None:
                return

    def __iter__(self) -> Iterator[Delta]:
        """Deltas of what the request holds beyond what this iterator yielded, whoever took it from the engine
        (this loop, or a cancel() from another thread): the deltas add up to the Completion, the last one carries
        the finish reason."""
        tokens_sent = text_sent = 0
        try:
            while True:
                if not self.finished:
                    self._poll(_POLL_S)
                with self._lock:
                    tokens, text, reason = self.token_ids[tokens_sent:], self.text[text_sent:], self.finish_reason
                tokens_sent += len(tokens)
                text_sent += len(text)
                if tokens or text or reason is not None:
                    yield Delta(text=text, token_ids=tokens, finish_reason=reason)
                if reason is not None:
                    return
        finally:
            if not self.finished:
                self.cancel()

    def result(self) -> Completion:
        # Without stop strings nothing needs to look at tokens as they come: sleep until the end.
        whole = self._stop is None
        while not self.finished:
            self._poll(_POLL_S, until_finished=whole)
        return self.completion()

    def completion(self) -> Completion:
        with self._lock:
            return Completion(text=self.text, token_ids=list(self.token_ids), finish_reason=self.finish_reason or "",
                              prompt_token_ids=list(self.prompt_token_ids),
                              logprobs=None if self.logprobs is None else [dict(d) for d in self.logprobs],
                              cached_tokens=self.cached_tokens)

    def cancel(self) -> None:
        """Stops the request; what it produced until then stays in token_ids, text and logprobs. A request that
        had already ended keeps its own finish reason."""
        if self.finished:
            return
        try:  # before the lock: a thread holding it in a wait is woken by the end
            self._gen._engine_call("cancel", self._rid)
        except RuntimeError:  # the Generator is closed
            pass
        with self._lock:
            try:
                while not self.finished:
                    self._take(self._gen._engine_call("wait", self._rid, _POLL_S))
            except (ValueError, RuntimeError):  # an error end, a closed Generator, or the id taken by another wait
                pass
            if self.finish_reason in (None, "error"):  # ended without its last output
                self._end_cancelled()

    def _end_cancelled(self) -> None:
        """Ends the request as cancelled; the text the detokenizer and stop matcher hold back is added."""
        self.text += self._held_text()[0]
        self.finish_reason = "cancelled"

    def _held_text(self, armed: bool = True) -> tuple[str, bool]:
        """At the end: the text of taken tokens that the detokenizer and the stop matcher still hold (cut at a stop
        string it completes, when armed: min_tokens reached), and whether one did."""
        tail = self._detok.flush() if self._detok else ""
        if self._stop is None:
            return tail, False
        piece, stopped = self._stop.feed(tail, armed)
        return (piece, True) if stopped else (piece + self._stop.flush(), False)

    def __del__(self):
        # Dropped unfinished (no result(), no cancel()): the engine stops it and keeps none of its output.
        if getattr(self, "finish_reason", "") is None:
            try:
                self._gen._engine_call("release", self._rid)
            except Exception:  # the Generator is closed (or was made before a fork)
                pass


class Generator:
    """Loads a Qwen model into the native engine and generates text.

    See docs/API.md for every argument. The engine runs on its own threads; generate/stream/chat may be
    called from several Python threads at once.
    """

    def __init__(self, model, *, device="auto", dtype="auto", max_batch_size: int | None = None,
                 max_model_len: int | None = None, rope_scaling: dict | None = None,
                 kv_cache_memory: int | None = None,
                 max_num_batched_tokens: int | None = None, seed: int = 0, load_format: str = "auto",
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9, page_size: int = 16,
                 revision: str | None = None, num_threads: int = 0, cuda_graphs: bool = True,
                 comm: str = "auto", comm_timeout: float = 120.0, max_logprobs: int = MAX_LOGPROBS,
                 enable_prefix_caching: bool = True, state_snapshots: int = 16, progress: bool = True,
                 check_weights: bool = True, quantization: str | None = None,
                 sparse_attention: SparseAttention | None = None, kv_offload_memory: int | None = None,
                 speculative_tokens: int = 0, speculative_max_batch: int = 8, synthetic_prefill: bool = False,
                 kv_cache_dtype: str = "auto", speculative_min_acceptance: float = 0.3,
                 speculative_pause_steps: int = 16, kv_staging_pages: int | None = None):
        self._engine = None
        self._close_lock = threading.Lock()  # one close() frees the engine; a concurrent one waits for it
        dev, index = _parse_device(device)
        # Defaults by device: a GPU serves many sequences per step, a CPU few.
        auto_batch = max_batch_size is None
        if auto_batch:
            max_batch_size = 256 if dev == "cuda" else 32
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 8192 if dev == "cuda" else 2048
        for name, v, lo in (("max_batch_size", max_batch_size, 1), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                            ("tensor_parallel_size", tensor_parallel_size, 1), ("page_size", page_size, 1),
                            ("seed", seed, 0), ("num_threads", num_threads, 0), ("max_logprobs", max_logprobs, 0),
                            ("state_snapshots", state_snapshots, 0), ("speculative_tokens", speculative_tokens, 0),
                            ("speculative_max_batch", speculative_max_batch, 1),
                            ("speculative_pause_steps", speculative_pause_steps, 0),
                            ("kv_staging_pages", 0 if kv_staging_pages is None else kv_staging_pages, 0)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < lo:
                raise ValueError(f"{name} must be >= {lo}, got {v}")
            hi = 2**64 - 1 if name == "seed" else MAX_THREADS if name == "num_threads" else INT32_MAX
            if v > hi:
                raise ValueError(f"{name} must be <= {hi}, got {v}")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)):
            raise TypeError("max_model_len must be an int or None")
        if max_model_len is not None and not 2 <= max_model_len <= INT32_MAX:
            raise ValueError(f"max_model_len must be in [2, {INT32_MAX}], got {max_model_len}")
        if kv_cache_memory is not None and (isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, int)):
            raise TypeError("kv_cache_memory must be an int (bytes) or None")
        if kv_cache_memory is not None and not 0 < kv_cache_memory < 2**63:
            raise ValueError(f"kv_cache_memory must be in (0, 2**63) bytes, got {kv_cache_memory}")
        if kv_offload_memory is not None and (isinstance(kv_offload_memory, bool)
                                              or not isinstance(kv_offload_memory, int)):
            raise TypeError("kv_offload_memory must be an int (bytes) or None")
        if kv_offload_memory is not None and not 0 < kv_offload_memory < 2**63:
            raise ValueError(f"kv_offload_memory must be in (0, 2**63) bytes, got {kv_offload_memory}")
        if isinstance(speculative_min_acceptance, bool) or not isinstance(speculative_min_acceptance, numbers.Real):
            raise TypeError("speculative_min_acceptance must be a number, got "
                            f"{type(speculative_min_acceptance).__name__}")
        if not 0 <= speculative_min_acceptance <= 1:
            raise ValueError(f"speculative_min_acceptance must be in [0, 1], got {speculative_min_acceptance}")
        if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, numbers.Real):
            raise TypeError(f"gpu_memory_utilization must be a number, got {type(gpu_memory_utilization).__name__}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        for name, v in (("cuda_graphs", cuda_graphs), ("enable_prefix_caching", enable_prefix_caching),
                        ("progress", progress), ("check_weights", check_weights),
                        ("synthetic_prefill", synthetic_prefill)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        if sparse_attention is not None and not isinstance(sparse_attention, SparseAttention):
            raise TypeError("sparse_attention must be a qwen_rt.SparseAttention or None, got "
                            f"{type(sparse_attention).__name__}")
        if kv_staging_pages and kv_offload_memory is None:  # (before the weights load)
            raise ValueError("kv_staging_pages needs a host tier (kv_offload_memory): it keeps selected host pages")
        if kv_staging_pages and sparse_attention is None:
            raise ValueError("kv_staging_pages needs sparse attention (it keeps selected host pages)")
        if quantization is not None and not isinstance(quantization, str):
            raise TypeError(f"quantization must be a str or None, got {type(quantization).__name__}")
        if not isinstance(kv_cache_dtype, str):
            raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        if comm not in ("auto", "nccl"):
            raise ValueError(f"comm must be 'auto' or 'nccl', got {comm!r}")
        if isinstance(comm_timeout, bool) or not isinstance(comm_timeout, (int, float)):
            raise TypeError("comm_timeout must be a number of seconds")
        if not comm_timeout > 0:  # also rejects NaN
            raise ValueError(f"comm_timeout must be > 0 seconds, got {comm_timeout}")

        files = resolve(model, load_format=load_format, revision=revision)
        self.config = text_config(files.config)
        if rope_scaling is not None:
            self.config = with_rope_scaling(self.config, rope_scaling)
        self.generation_config = dict(files.generation_config)
        # Qwen3.5's multimodal layout keeps the text weights under model.language_model.
        prefix = MULTIMODAL_PREFIX if any(name.startswith(MULTIMODAL_PREFIX) for name in files.tensors) else "model."
        ncfg = native_config(self.config, prefix, quantization)
        if auto_batch and dev == "cuda" and "linear_attention" in ncfg.layer_types:
            # Hybrid models keep a DeltaNet state per slot (Qwen3.8-27B: ~150 MB each): fewer slots by default.
            max_batch_size = 64
        # As transformers 5: tied embeddings, but the checkpoint has its own, different lm_head: that one is used.
        head = files.tensors.get("lm_head.weight")
        embed = files.tensors.get(ncfg.weight_prefix + "embed_tokens.weight")
        if ncfg.tie_embeddings and head is not None and not same_tensor(head, embed):
            ncfg.tie_embeddings = False
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(files.root) if files.root else None
        # Why there is no tokenizer, for the errors that need one.
        self._no_tokenizer = "this model has no tokenizer"
        if self.tokenizer is None and files.root and (Path(files.root) / "vocab.json").is_file():
            self._no_tokenizer = ("this model has no tokenizer.json (vocab.json and merges.txt alone are not read: "
                                  "transformers' save_pretrained of its tokenizer writes tokenizer.json)")
        wdt, adt = _resolve_dtypes(dev, dtype, _stored_dtype(files.tensors, config_dtype(self.config)))
        self.vocab_size = ncfg.vocab_size
        # Top logprobs a request may ask for: each one costs a pass over the vocabulary and host memory per row.
        self.max_logprobs = max_logprobs
        self._defaults = self._sampling_defaults()
        self._eos = self._eos_ids()

        opts = _core.EngineOptions()
        opts.device = dev
        opts.device_index = index
        opts.weight_dtype = wdt
        opts.act_dtype = adt
        opts.max_batch_size = max_batch_size
        opts.max_model_len = max_model_len or 0
        opts.max_num_batched_tokens = max_num_batched_tokens
        opts.page_size = page_size
        opts.kv_cache_memory = kv_cache_memory or 0
        opts.kv_offload_memory = kv_offload_memory or 0
        opts.kv_cache_dtype = kv_cache_dtype
        opts.gpu_memory_utilization = float(gpu_memory_utilization)
        opts.tensor_parallel_size = tensor_parallel_size
        opts.dummy_weights = load_format == "dummy"
        opts.seed = seed
        opts.num_threads = num_threads
        opts.cuda_graphs = cuda_graphs
        opts.comm = comm
        opts.comm_timeout_s = float(comm_timeout)
        opts.prefix_caching = enable_prefix_caching
        opts.state_snapshots = state_snapshots
        opts.check_weights = check_weights
        opts.speculative_tokens = speculative_tokens
        opts.speculative_max_batch = speculative_max_batch
        opts.speculative_min_acceptance = float(speculative_min_acceptance)
        opts.speculative_pause_steps = speculative_pause_steps
        opts.synthetic_prefill = synthetic_prefill
        opts.kv_staging_pages = -1 if kv_staging_pages is None else kv_staging_pages
        if sparse_attention is not None:
            opts.sparse_budget_tokens = sparse_attention.budget_tokens
            opts.sparse_sink_tokens = sparse_attention.sink_tokens
            opts.sparse_window_tokens = sparse_attention.window_tokens
        tensors = [] if opts.dummy_weights else [
            _core.TensorSource(t.name, str(t.path), t.offset, t.nbytes, t.dtype, list(t.shape))
            for t in files.tensors.values()]
        bar = _Progress(progress and os.environ.get("QWEN_RT_PROGRESS", "1") != "0")
        try:
            self._engine = _core.Engine(ncfg, tensors, opts, bar)
        finally:
            bar.close()
        _open_generators.add(self)
        self.device = f"{dev}:{index}" if dev == "cuda" else "cpu"
        self.dtype = adt
        self.weight_dtype = wdt
        self.quantization = "fp8" if ncfg.fp8_scales else None  # FP8 linears (from the checkpoint or at load)
        st = self._engine.stats()
        self.max_model_len = st["max_model_len"]
        # The most tokens one request can reach: max_model_len, or fewer where the KV pool holds fewer (it holds
        # every token of a request but its last). An unset max_tokens stops there.
        self._longest = min(self.max_model_len, st["total_pages"] * st["page_size"] + 1)

    # -- setup helpers -----------------------------------------------------------------------------

    def _sampling_defaults(self) -> dict:
        """generation_config.json's sampling defaults, each checked (ValueError naming the key), so a bad one fails
        the load rather than every request."""
        g = self.generation_config
        d = {}
        for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
            if g.get(k) is not None:
                d[k] = g[k]
        if g.get("do_sample") is False:
            d["temperature"] = 0.0
        if g.get("max_new_tokens") is not None:
            d["max_tokens"] = g["max_new_tokens"]
        try:
            SamplingParams().resolved(d).validate(self.vocab_size, self.max_logprobs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation_config.json: {e}") from None
        return d

    def _eos_ids(self) -> list[int]:
        """generation_config.json's eos_token_id, else config.json's, else the tokenizer's (each file's checked)."""
        found = []
        for where, src in (("generation_config.json", self.generation_config.get("eos_token_id")),
                           ("config.json", self.config.get("eos_token_id"))):
            if src is not None:
                ids = [src] if is_int(src) else src
                if not isinstance(ids, list) or not all(is_int(i) for i in ids):
                    raise ValueError(f"{where}'s eos_token_id must be an integer or a list of integers, "
                                     f"got {src!r}"[:300])
                found.append([int(i) for i in ids if 0 <= i < self.vocab_size])
        if found:
            return found[0]
        return list(self.tokenizer.eos_token_ids) if self.tokenizer else []

    def _engine_call(self, name, *args):
        global _native_calls
        with _native_calls_lock:  # counted from before the handle is read: the exit waits for the call's end
            engine = self._engine  # read once: close() from another thread may clear it
            if engine is None:
                raise GeneratorClosed("the Generator is closed")
            _native_calls += 1
        try:
            return getattr(engine, name)(*args)
        except RuntimeError as e:
            if self._engine is None:  # close() cleared the handle while the call ran
                raise GeneratorClosed("the Generator is closed") from e
            raise
        finally:
            with _native_calls_lock:
                _native_calls -= 1

    # -- request building --------------------------------------------------------------------------

    def _params(self, sampling, kwargs) -> SamplingParams:
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if kwargs:
            sampling = sampling.replace(**kwargs)
        p = sampling.resolved(self._defaults)
        p.validate(self.vocab_size, self.max_logprobs)
        if p.stop_strings() and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer ({self._no_tokenizer}): use stop_token_ids")
        return p

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self._no_tokenizer}: pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            bad = [t for t in prompt if not is_int(t)][:1]
            if bad:
                raise TypeError(f"a token-id prompt must be a list of int, and holds a {type(bad[0]).__name__}")
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    @staticmethod
    def _sets_max_tokens(sampling, kwargs) -> bool:
        if "max_tokens" in kwargs:
            return kwargs["max_tokens"] is not None
        return isinstance(sampling, SamplingParams) and sampling.max_tokens is not None

    def _check_length(self, ids: list[int], p: SamplingParams) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if len(ids) + p.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) exceeds max_model_len "
                             f"{self.max_model_len}")

    @staticmethod
    def _as_lists(prompts):
        """A NumPy array of token ids (1-D: one prompt, 2-D: one per row) as lists of Python ints."""
        if hasattr(prompts, "tolist") and hasattr(prompts, "ndim") and prompts.ndim in (1, 2):
            return prompts.tolist()
        return prompts

    @classmethod
    def _prompt_list(cls, prompts) -> list:
        prompts = cls._as_lists(prompts)
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts is empty")
            items = [cls._as_lists(p) for p in prompts]
            if all(isinstance(p, (str, list, tuple)) for p in items):
                return items
            return [list(prompts)]  # one token-id prompt (_prompt_ids names an element that is no int)
        raise TypeError("prompts must be a str, a list of str, a list of token ids or a list of lists of token ids")

    def _native_sampling(self, p: SamplingParams) -> "_core.SamplingOptions":
        s = _core.SamplingOptions()
        s.temperature = float(p.temperature)
        s.top_k = int(p.top_k)
        s.top_p = float(p.top_p)
        s.min_p = float(p.min_p)
        s.repetition_penalty = float(p.repetition_penalty)
        s.presence_penalty = float(p.presence_penalty)
        s.frequency_penalty = float(p.frequency_penalty)
        s.seed = -1 if p.seed is None else int(p.seed)
        s.max_tokens = int(p.max_tokens)
        s.min_tokens = int(p.min_tokens)
        s.logprobs = int(p.logprobs or 0)
        s.ignore_eos = bool(p.ignore_eos)
        s.speculative = bool(p.speculative)
        s.stop_token_ids = list(p.stop_token_ids or [])
        s.eos_token_ids = list(self._eos)
        return s

    def _submit_many(self, prompts, sampling, kwargs) -> list[Request]:
        ids_list = [self._prompt_ids(x) for x in self._prompt_list(prompts)]
        if isinstance(sampling, (list, tuple)):  # one SamplingParams per prompt
            if len(sampling) != len(ids_list):
                raise ValueError(f"sampling has {len(sampling)} entries for {len(ids_list)} prompts")
            params = [self._params(x, kwargs) for x in sampling]
            natives = [self._native_sampling(p) for p in params]
        else:  # one for all: resolved and converted once
            params = [self._params(sampling, kwargs)] * len(ids_list)
            natives = [self._native_sampling(params[0])] * len(ids_list)
        # A max_tokens the caller did not set (the default, or generation_config's) stops at the room the
        # prompt leaves (in max_model_len and the KV pool); one the caller set must fit (_check_length).
        set_by_caller = [self._sets_max_tokens(x, kwargs) for x in sampling] if isinstance(sampling, (list, tuple)) \
            else [self._sets_max_tokens(sampling, kwargs)] * len(ids_list)
        for i, ids in enumerate(ids_list):
            room = self._longest - len(ids)
            if not set_by_caller[i] and 1 <= room < params[i].max_tokens:
                params[i] = dataclasses.replace(params[i], max_tokens=room)
                if params[i].min_tokens > room:
                    raise ValueError(f"min_tokens ({params[i].min_tokens}) exceeds the {room} tokens the prompt "
                                     f"leaves in max_model_len {self.max_model_len} and the KV cache")
                natives[i] = self._native_sampling(params[i])
            self._check_length(ids, params[i])
        reqs: list[Request] = []
        try:
            for ids, p, native in zip(ids_list, params, natives):
                rid = self._engine_call("submit", ids, native)
                try:
                    reqs.append(Request(self, rid, ids, p))
                except BaseException:  # (Ctrl-C) a submitted request without its handle: the engine drops it
                    self._engine_call("release", rid)
                    raise
        except BaseException:
            for r in reqs:
                r.cancel()
            raise
        return reqs

    # -- public API --------------------------------------------------------------------------------

    def submit(self, prompt, sampling: SamplingParams | None = None, **kwargs) -> Request:
        """Queues one prompt and returns its Request at once."""
        prompt = self._as_lists(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(
                isinstance(self._as_lists(t), (str, list, tuple)) for t in prompt):
            raise TypeError("submit takes one prompt: a str or a list of token ids")
        return self._submit_many(prompt, sampling, kwargs)[0]

    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None,
                 **kwargs) -> list[Completion]:
        """Generates for one or many prompts (batched together); returns one Completion per prompt. sampling: one
        SamplingParams for all, or a list with one per prompt; keyword arguments override fields of each."""
        reqs = self._submit_many(prompts, sampling, kwargs)
        try:
            return self._results(reqs)
        except BaseException:
            for r in reqs:
                r.cancel()
            raise

    def _results(self, reqs: list[Request]) -> list[Completion]:
        """The requests' completions, in order. Those with stop strings are read as their tokens arrive, all in
        turn, so each one ends at its stop string wherever it is in the list (read one after another, a later
        request would run on to max_tokens while the earlier ones finish)."""
        watched = [r for r in reqs if r._stop is not None]
        while watched:
            try:
                ready = self._engine_call("wait_any", [r._rid for r in watched], _POLL_S) >= 0
            except GeneratorClosed:
                ready = True  # each poll ends its request as cancelled
            if ready:
                for r in watched:
                    r._poll(0.0)
            watched = [r for r in watched if not r.finished]
        return [r.result() for r in reqs]

    def stream(self, prompt, sampling: SamplingParams | None = None, **kwargs) -> Iterator[Delta]:
        """Submits at once (bad input raises here) and returns an iterator of Deltas as tokens arrive; leaving the
        loop early cancels the request."""
        return iter(self.submit(prompt, sampling, **kwargs))

    def chat(self, messages, sampling: SamplingParams | None = None, *, chat_template_kwargs: dict | None = None,
             **kwargs) -> Completion:
        """Applies the tokenizer's chat template (with the generation prompt) and generates the reply."""
        return self.generate([self.chat_prompt(messages, **(chat_template_kwargs or {}))], sampling, **kwargs)[0]

    def chat_prompt(self, messages, **template_kwargs) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self._no_tokenizer}, so no chat template")
        text = self.tokenizer.apply_chat_template(messages, **template_kwargs)
        return self.tokenizer.encode(text)

    async def agenerate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None,
                        **kwargs) -> list[Completion]:
        reqs = self._submit_many(prompts, sampling, kwargs)
        try:
            return await asyncio.to_thread(self._results, reqs)
        except BaseException:
            for r in reqs:
                r.cancel()
            raise

    def astream(self, prompt, sampling: SamplingParams | None = None, **kwargs):
        """stream() for asyncio: submits at once (bad input raises here); `async for` over the result."""
        return self._astream(self.submit(prompt, sampling, **kwargs))

    @staticmethod
    async def _astream(req: Request):
        it = iter(req)
        done = object()
        try:
            while True:
                d = await asyncio.to_thread(next, it, done)
                if d is done:
                    return
                yield d
        finally:
            if not req.finished:
                req.cancel()

    def stats(self) -> dict:
        return self._engine_call("stats")

    def close(self) -> None:
        """Stops the engine and frees every byte it took (idempotent)."""
        with self._close_lock:
            # Cleared first: a request whose wait fails from here on sees a closed Generator and ends "cancelled".
            engine, self._engine = self._engine, None
            if engine is not None:
                engine.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
