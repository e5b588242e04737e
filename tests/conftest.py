"""Shared fixtures: tiny checkpoints built once per session (per xdist worker) and cached
qwen_rt Generators over them. See models.py for the builders and the transformers references."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import models as M  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:  # keep transformers quiet (the yarn config's explicit-factor notice, load bars)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
except Exception:  # pragma: no cover
    pass

try:  # the reference runs beside the library on 2 cores: keep torch from oversubscribing
    import torch

    torch.set_num_threads(1)
except Exception:  # pragma: no cover
    pass


base_kwargs = M.base_kwargs


@pytest.fixture(scope="session")
def build(tmp_path_factory):
    """build(name) -> folder of fixture config `name` (built once); "<name>+legacy" gives the same
    weights with a pre-transformers-5 config.json (top-level rope_theta + rope_scaling), "<name>+notok" the
    same model without tokenizer.json, "<name>+multimodal" a Qwen3.5 model in Qwen's multimodal layout,
    "<name>+mtp_random" / "<name>+mtp_echo" a Qwen3.5 model with an MTP head (models.add_mtp)."""
    cache: dict[str, Path] = {}
    lock = threading.Lock()

    def _build(name: str) -> Path:
        with lock:
            if name in cache:
                return cache[name]
            base, _, variant = name.partition("+")
            if variant:
                src = _build_unlocked(base)
                dst = M.copy_folder(src, tmp_path_factory.mktemp(name.replace("+", "_")) / "m")
                if variant == "legacy":
                    M.to_legacy_rope(dst)
                elif variant == "notok":  # the same model without its tokenizer
                    (dst / "tokenizer.json").unlink()
                elif variant == "multimodal":  # a Qwen3.5 model in Qwen's Qwen3_5ForConditionalGeneration layout
                    M.to_multimodal_layout(dst)
                elif variant in ("mtp_random", "mtp_echo"):  # a Qwen3.5 model with an MTP head (models.add_mtp)
                    M.add_mtp(dst, variant[4:])
                else:
                    raise KeyError(name)
                cache[name] = dst
            else:
                cache[name] = M.build_model(tmp_path_factory.mktemp(name), name)
            return cache[name]

    def _build_unlocked(name):
        if name not in cache:
            cache[name] = M.build_model(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return _build


@pytest.fixture(scope="session")
def make_gen():
    """make_gen(folder, **kw) -> a qwen_rt.Generator, cached by (folder, kw) for the session and
    closed at its end. Tests must leave a cached generator idle (no request running)."""
    import qwen_rt

    cache = {}

    def _make(folder, **kw):
        full = base_kwargs(folder, **kw)
        key = (str(folder), tuple(sorted(full.items())))
        if key not in cache:
            cache[key] = qwen_rt.Generator(str(folder), **full)
        return cache[key]

    yield _make
    for g in cache.values():
        try:
            g.close()
        except Exception:
            pass


@pytest.fixture
def fresh_gen():
    """fresh_gen(folder, **kw) -> a new Generator owned by one test, closed after it."""
    import qwen_rt

    made = []

    def _make(folder, **kw):
        g = qwen_rt.Generator(str(folder), **base_kwargs(folder, **kw))
        made.append(g)
        return g

    yield _make
    for g in made:
        try:
            g.close()
        except Exception:
            pass


def wait_idle(gen, timeout: float = 10.0) -> dict:
    """Polls gen.stats() until every slot and page is free and nothing runs or waits; returns
    the last stats (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        s = gen.stats()
        idle = (s["free_slots"] == s["total_slots"] and s["free_pages"] == s["total_pages"]
                and s["running"] == 0 and s["waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.01)


@pytest.fixture
def idle():
    return wait_idle
