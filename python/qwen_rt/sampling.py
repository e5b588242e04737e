"""SamplingParams (what a request asks for) and the results: Completion and Delta."""
from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from dataclasses import dataclass, field, fields

__all__ = ["SamplingParams", "Completion", "Delta"]

DEFAULT_MAX_TOKENS = 256
INT32_MAX = 2**31 - 1


def is_int(v) -> bool:
    """An integer, Python's or NumPy's, and not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _float32(name: str, v) -> float:
    """v rounded to float32 (the engine's type); ValueError when it does not fit."""
    try:
        x = struct.unpack("f", struct.pack("f", float(v)))[0]
    except OverflowError:
        x = math.inf
    if math.isinf(x):
        try:
            shown = f"{v:.6g}"
        except OverflowError:  # an int beyond even float64
            shown = f"an int of {len(str(abs(v)))} digits"
        raise ValueError(f"{name} is too large in magnitude for float32 (about 3.4e38), got {shown}")
    return x


MIN_TEMPERATURE = _float32("temperature", 1e-6)  # the engine's 1e-6f


@dataclass
class SamplingParams:
    """Sampling parameters of one request. Fields left None take the model's generation_config.json
    value, else the documented default."""

    max_tokens: int | None = None          # default 256
    min_tokens: int = 0
    temperature: float | None = None       # default 1.0; 0 is greedy
    top_k: int | None = None               # default 0 (off)
    top_p: float | None = None             # default 1.0 (off)
    min_p: float | None = None             # default 0.0 (off)
    repetition_penalty: float | None = None  # default 1.0 (off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None            # top-N logprobs per generated token
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    speculative: bool = True               # drafts from the MTP head where the Generator speculates (the same tokens)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def replace(self, **changes) -> "SamplingParams":
        unknown = set(changes) - self.field_names()
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def resolved(self, defaults: dict) -> "SamplingParams":
        """A copy with every None field filled from defaults (generation_config) or the built-in default."""
        builtin = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                   "min_p": 0.0, "repetition_penalty": 1.0}
        out = dataclasses.replace(self)
        for name, value in builtin.items():
            if getattr(out, name) is None:
                setattr(out, name, defaults.get(name, value))
        return out

    def validate(self, vocab_size: int, max_logprobs: int | None = None) -> None:
        """Raises TypeError / ValueError naming the first bad field. Call on a resolved copy.
        max_logprobs: the Generator's bound on logprobs (None: the vocabulary)."""
        def number(name, lo=None, lo_open=False, hi=None, hi_open=False, integer=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or (integer and not is_int(v)):
                raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {type(v).__name__}")
            if not integer and not is_int(v) and not math.isfinite(v):  # (an int may exceed any float)
                raise ValueError(f"{name} must be finite, got {v}")
            # The engine holds it as an int32 or a float32: the value and what the engine holds must both be in
            # bounds (top_p=1e-50 is 0 in float32; -1e-46 is -0.0).
            if integer and name != "seed" and v > INT32_MAX:
                raise ValueError(f"{name} must be <= {INT32_MAX}, got {v}")
            x = v if integer else _float32(name, v)
            shown = f"{v}" if x == v or integer else f"{v} ({x} in float32)"
            for y in (v, x):
                if lo is not None and (y <= lo if lo_open else y < lo):
                    raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {shown}")
                if hi is not None and (y >= hi if hi_open else y > hi):
                    raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {shown}")
            return x

        number("max_tokens", lo=1, integer=True)
        number("min_tokens", lo=0, integer=True)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        t = number("temperature", lo=0)
        if self.temperature != 0 and t < MIN_TEMPERATURE:  # the engine divides the logits by 1e-6 or more, in float32
            raise ValueError(f"temperature must be 0 (greedy) or >= 1e-6, got {self.temperature}")
        number("top_k", lo=0, integer=True)
        number("top_p", lo=0, lo_open=True, hi=1)
        number("min_p", lo=0, hi=1)
        number("repetition_penalty", lo=0, lo_open=True)
        number("presence_penalty")
        number("frequency_penalty")
        if self.seed is not None:
            number("seed", lo=0, integer=True)
            if self.seed >= 2**63:
                raise ValueError("seed must be < 2**63")
        if self.logprobs is not None:
            number("logprobs", lo=0, hi=vocab_size, integer=True)
            if max_logprobs is not None and self.logprobs > max_logprobs:
                raise ValueError(f"logprobs must be <= {max_logprobs} (the Generator's max_logprobs), "
                                 f"got {self.logprobs}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise TypeError("stop must be a str or a list of str")
            if any(s == "" for s in stops):
                raise ValueError("stop strings must not be empty")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    is_int(t) for t in self.stop_token_ids):
                raise TypeError("stop_token_ids must be a list of int")
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError("ignore_eos must be a bool")
        if not isinstance(self.speculative, bool):
            raise TypeError("speculative must be a bool")

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


@dataclass
class Completion:
    """The result of one request."""
    text: str
    token_ids: list[int]
    finish_reason: str            # "stop" | "length" | "cancelled"
    prompt_token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    cached_tokens: int = 0        # prompt tokens whose K/V came from the prefix cache (not computed)


@dataclass
class Delta:
    """New output of a streaming request since the previous delta."""
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
