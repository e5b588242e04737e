"""Seeded fuzzing of what a model folder holds: safetensors headers (against the reference library, then loaded by
a Generator) and config.json values. Every case ends in a ValueError / TypeError or a correct load that serves a
request; never a crash, a hang or another exception. Cases run in batches, each batch in a subprocess with a
timeout, which prints every case before it runs so a crash names its case."""
from __future__ import annotations

import copy
import json
import os
import random
import struct
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import models as M

TESTS = Path(__file__).resolve().parent
MODEL = "qwen3_mha_untied"
BATCH_TIMEOUT_S = 90

# --- mutations -----------------------------------------------------------------------------------------------------

HOSTILE_INTS = [0, -1, 1, 2, 3, 7, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
HOSTILE = HOSTILE_INTS + [0.5, 64.7, 1e308, -1e308, float("nan"), float("inf"), "", "64", "x" * 1000, True, False,
                          None, [], [1], {}, {"a": 1}, [[[]]]]
DTYPES = ["F32", "F16", "BF16", "I64", "U8", "F8_E4M3", "F4", "F6_E2M3", "BOOL", "C64", "float32", "f32", "", None, 5,
          "F8_E4M3FN"]


def split_file(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_file(header_text: bytes, data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_text) if length is None else length) + header_text + data


def mutate_safetensors(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One to three mutations of a valid safetensors file; returns the bytes and what was done."""
    header, data = split_file(raw)
    names = [k for k in header if k != "__metadata__"]
    done, text, length = [], None, None
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(16)
        name = rng.choice(names)
        entry = header.get(name)
        if not isinstance(entry, dict):
            continue
        if op == 0:
            entry["dtype"] = rng.choice(DTYPES)
        elif op == 1:
            entry["shape"] = rng.choice([[], [0], [-1], [2**63], [2**63, 0], [2**64], [1.5], ["3"], None, {},
                                         [2**63, 2, 0], [rng.choice(HOSTILE_INTS)]])
        elif op == 2:
            shape = list(entry["shape"])
            rng.shuffle(shape)
            entry["shape"] = shape if rng.random() < 0.5 else [x for d in shape for x in (d, 1)]  # same element count
        elif op == 3:
            other = header[rng.choice(names)]
            entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        elif op == 4:
            b, e = entry["data_offsets"]
            d = rng.choice([-8, -4, -2, -1, 1, 2, 4, 8])
            entry["data_offsets"] = rng.choice([[b + d, e + d], [b, e + d], [b + d, e], [e, b]])
        elif op == 5:
            entry["data_offsets"] = rng.choice([[0, 2**64], [0], [0, 0, 0], [0.0, 4.0], [-4, 0], None, "0,4",
                                                [rng.choice(HOSTILE_INTS), rng.choice(HOSTILE_INTS)]])
        elif op == 6:
            del header[name]
            names.remove(name)
            if not names:
                break
        elif op == 7:
            header[f"extra.{rng.randrange(9)}"] = {"dtype": rng.choice(DTYPES), "shape": [rng.randrange(5)],
                                                  "data_offsets": [0, rng.randrange(9)]}
        elif op == 8:
            header["__metadata__"] = rng.choice([{"format": "pt"}, {"format": 1}, [], "x", None, {"a": {"b": "c"}},
                                                 {"n": float("nan")}])
        elif op == 9:
            entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(HOSTILE)
        elif op == 10:  # duplicate key in the JSON text: the first of two entries
            text = json.dumps(header).encode()
            key = json.dumps(name).encode()
            text = text.replace(key + b":", key + b":" + json.dumps(entry).encode() + b"," + key + b":", 1)
        elif op == 11:  # a byte of the header changed
            text = bytearray(text or json.dumps(header).encode())
            text[rng.randrange(len(text))] = rng.randrange(256)
            text = bytes(text)
        elif op == 12:
            length = rng.choice([0, 1, 7, 2**63, 2**64 - 1, 100_000_001, len(json.dumps(header)) + rng.randint(-8, 8)])
        elif op == 13:
            data = data[:rng.randrange(len(data) + 1)] if rng.random() < 0.7 else data + b"\0" * rng.randint(1, 64)
        elif op == 14:
            text = b'{"x":' + b"[" * rng.choice([1000, 100000]) + b"]" * 3 + b"}"
        else:  # whitespace around the header: still valid
            text = b"  " + (text or json.dumps(header).encode()) + b"\n  "
        done.append(f"{op}:{name}")
    if text is None:
        text = json.dumps(header).encode()
    return join_file(text, data, length), " ".join(done)


CONFIG_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
               "hidden_act", "attention_bias", "architectures", "model_type", "rope_theta", "rope_scaling",
               "rope_parameters", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
               "quantization_config", "text_config", "eos_token_id", "dtype", "torch_dtype",
               "original_max_position_embeddings"]
ROPE_KEYS = ["rope_type", "type", "factor", "rope_theta", "original_max_position_embeddings", "attention_factor",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"]


def mutate_config(cfg: dict, rng: random.Random) -> tuple[bytes, str]:
    """One to three changed, removed or corrupted values of a config.json; returns its bytes and what was done."""
    cfg = copy.deepcopy(cfg)
    done = []
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(CONFIG_KEYS)
        op = rng.randrange(10)
        if op == 0:
            cfg.pop(key, None)
            done.append(f"del {key}")
        elif op <= 2 and key in ("rope_parameters", "rope_scaling"):
            block = cfg.get(key)
            block = dict(block) if isinstance(block, dict) and block else {
                "rope_type": rng.choice(["yarn", "linear", "default", "dynamic"])}
            k = rng.choice(ROPE_KEYS)
            block[k] = rng.choice(HOSTILE + ["yarn", "linear"])
            cfg[key] = block
            done.append(f"{key}.{k}={block[k]!r}"[:80])
        elif op <= 4 and isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
            v = cfg[key] * rng.choice([0, 2, 3, -1]) + rng.choice([0, 1, -1])
            cfg[key] = v
            done.append(f"{key}={v}")
        else:
            cfg[key] = rng.choice(HOSTILE)
            done.append(f"{key}={cfg[key]!r}"[:80])
    text = json.dumps(cfg).encode()
    r = rng.random()
    if r < 0.05:
        text = text[:rng.randrange(len(text))]
        done.append("truncated")
    elif r < 0.1:
        text = b'{"hidden_size":' + b"[" * 100000 + b"]" * 100000 + b"}"
        done.append("nested")
    elif r < 0.13:
        text = text.replace(b"{", b'{"vocab_size": 7, ', 1)
        done.append("duplicate key")
    return text, " ".join(done)


# --- running a batch (in the subprocess) ---------------------------------------------------------------------------

def serve_once(folder: Path) -> str:
    """Loads the folder and serves one greedy request; the outcome's name. Raises what the library raised when it
    is not a clean one."""
    import qwen_rt
    try:
        g = qwen_rt.Generator(str(folder), device="cpu", dtype="float32", max_batch_size=2, max_model_len=32,
                              kv_cache_memory=1 << 20, progress=False)
    except (ValueError, TypeError) as e:
        return f"refused: {type(e).__name__}: {str(e)[:120]}"
    try:
        c = g.generate([[5, 6, 7]], max_tokens=2, temperature=0.0)[0]
        assert c.finish_reason in ("length", "stop") and 1 <= len(c.token_ids) <= 2, c
        return "served"
    except RuntimeError as e:  # a loaded model whose values overflow: that request fails, cleanly
        if "non-finite logits" not in str(e):
            raise
        return "non-finite"
    finally:
        g.close()


def header_case(raw: bytes, path: Path) -> str:
    """Our reader against the reference: both refuse, or both read the same tensors (we also refuse duplicate keys
    and dimensions of 2**63 or more, which the reference takes)."""
    from safetensors import safe_open

    from qwen_rt.model_files import read_safetensors_header
    path.write_bytes(raw)
    try:
        ours = read_safetensors_header(path)
    except ValueError as e:
        ours = e
    try:
        with safe_open(str(path), framework="numpy") as f:
            ref = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - the reference's own error types
        ref = e
    if isinstance(ours, ValueError):
        stricter = "duplicate key" in str(ours) or "2**63" in str(ours)
        assert isinstance(ref, Exception) or stricter, f"we refused what the reference reads: {ours}"
        return "refused"
    assert not isinstance(ref, Exception), f"we read what the reference refuses: {ref}"
    assert {k: (t.dtype, t.shape) for k, t in ours.items()} == ref
    return "read"


def run_batch(kind: str, seed: int, count: int, src: str, work: str) -> None:
    """Runs `count` cases of `kind` from `seed`; prints 'case i: what' before each and its outcome after."""
    import shutil
    rng = random.Random(seed)
    src, work = Path(src), Path(work)
    folder = work / "m"
    shutil.copytree(src, folder)
    good_weights = (src / "model.safetensors").read_bytes()
    good_config = json.loads((src / "config.json").read_text())
    for i in range(count):
        if kind == "config":
            raw, what = mutate_config(good_config, rng)
        else:
            raw, what = mutate_safetensors(good_weights, rng)
        print(f"case {i}: {what}", flush=True)
        if kind == "header":
            outcome = header_case(raw, work / "t.safetensors")
        else:
            (folder / "config.json").write_bytes(raw if kind == "config" else json.dumps(good_config).encode())
            (folder / "model.safetensors").write_bytes(raw if kind == "load" else good_weights)
            outcome = serve_once(folder)
        print(f"  -> {outcome}", flush=True)
    print("batch done", flush=True)


# --- the tests ------------------------------------------------------------------------------------------------------

def fuzz(build, tmp_path, kind: str, seed: int, count: int) -> str:
    code = (f"import test_fuzz as F; F.run_batch({kind!r}, {seed}, {count}, {str(build(MODEL))!r}, "
            f"{str(tmp_path)!r})")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BATCH_TIMEOUT_S,
                           cwd=str(TESTS), env={**os.environ, "QWEN_RT_PROGRESS": "0"})
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{kind} fuzz seed {seed} hung; last case: {out.strip().splitlines()[-1:]}")
    last = [line for line in p.stdout.splitlines() if line.startswith("case ")][-1:]
    assert p.returncode == 0 and p.stdout.rstrip().endswith("batch done"), \
        f"{kind} fuzz seed {seed}: exit {p.returncode} at {last}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_safetensors_headers(build, tmp_path, seed):
    out = fuzz(build, tmp_path, "header", seed, 200)
    assert out.count("-> read") >= 5 and out.count("-> refused") >= 50, out[-2000:]  # both kinds are exercised


@pytest.mark.parametrize("seed", [3, 4])
def test_fuzz_safetensors_load(build, tmp_path, seed):
    out = fuzz(build, tmp_path, "load", seed, 60)
    assert "-> served" in out and "-> refused" in out, out[-2000:]


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_fuzz_config(build, tmp_path, seed):
    out = fuzz(build, tmp_path, "config", seed, 60)
    assert "-> served" in out and "-> refused" in out, out[-2000:]
