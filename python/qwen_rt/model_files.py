"""Finding a model's files: a local folder, a Hugging Face Hub id, or a packaged config name.

`resolve()` returns the parsed config.json, generation_config.json and where every tensor lies in
its safetensors file (read from the headers by hand: no torch, no weights read).
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TensorInfo", "ModelFiles", "resolve", "text_config", "packaged_configs", "packaged_name",
           "read_safetensors_header"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# Bytes per element of each safetensors dtype (F4 / F6 packings are not element-addressable; they are
# accepted without a size check).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
    "C64": 8,
}

# Hub ids that name a packaged config (lower case) -> packaged name.
_ALIASES = {
    "qwen/qwen3-0.6b": "qwen3-0.6b",
    "qwen/qwen3-8b": "qwen3-8b",
    "qwen/qwen3-32b": "qwen3-32b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen3.8-27b": "qwen3.8-27b",
}

# A Qwen model named without its owner ("qwen3-4b", "Qwen2.5-7B-Instruct"): meant as a packaged config or hub id.
_QWEN_SIZE_NAME = re.compile(r"qwen[0-9.]*-.*[0-9]b", re.IGNORECASE)

_HUB_PATTERNS_META = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "chat_template.jinja", "additional_chat_templates/*.jinja", "model.safetensors.index.json"]

_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass
class TensorInfo:
    name: str
    path: str
    offset: int          # absolute byte offset of the tensor's data in the file
    nbytes: int
    dtype: str           # safetensors name: "F32", "BF16", "F16", "F8_E4M3", "I64", ...
    shape: tuple[int, ...]


@dataclass
class ModelFiles:
    root: Path | None                 # folder holding config/tokenizer/weights; None for packaged configs
    config: dict
    generation_config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    name: str = ""


# ----------------------------------------------------------------------------------------------------
# safetensors headers

def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parses one safetensors file's header. ValueError (naming the file) if it is truncated or corrupt."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file (only {len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n == 0 or n > _MAX_HEADER or 8 + n > size:
                raise ValueError(f"{path}: corrupt safetensors header (header length {n}, file size {size})")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    if len(raw) != n:
        raise ValueError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")

    data_start = 8 + n
    data_size = size - data_start
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
            if not (isinstance(dtype, str) and _int_list(shape) and _int_list(offsets) and len(offsets) == 2):
                raise TypeError("dtype must be a string, shape and data_offsets lists of integers")
            shape = tuple(shape)
            begin, end = offsets
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header entry for {name!r} ({e!r})") from e
        if begin < 0 or end < begin or end > data_size or any(d < 0 for d in shape):
            raise ValueError(
                f"{path}: tensor {name!r} lies outside the file (data_offsets [{begin}, {end}], "
                f"{data_size} data bytes): truncated or corrupt file")
        elem = DTYPE_SIZES.get(dtype)
        if elem is not None and math.prod(shape) * elem != end - begin:
            raise ValueError(
                f"{path}: tensor {name!r} has {end - begin} bytes but {dtype}{list(shape)} needs "
                f"{math.prod(shape) * elem}")
        out[name] = TensorInfo(name=name, path=str(path), offset=data_start + begin, nbytes=end - begin,
                               dtype=dtype, shape=shape)
    return out


def same_tensor(a: TensorInfo, b: TensorInfo | None) -> bool:
    """Whether two stored tensors hold the same dtype, shape and bytes (read in 64 MiB pieces)."""
    if b is None or a.dtype != b.dtype or a.shape != b.shape or a.nbytes != b.nbytes:
        return False
    step = 64 << 20
    with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
        for off in range(0, a.nbytes, step):
            n = min(step, a.nbytes - off)
            fa.seek(a.offset + off)
            fb.seek(b.offset + off)
            if fa.read(n) != fb.read(n):
                return False
    return True


def _int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _read_weights(root: Path) -> dict[str, TensorInfo]:
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors_header(single)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not an object of file names")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: corrupt index ({e!r})") from e
        shards = sorted(set(weight_map.values()))
        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            p = root / shard
            if not p.is_file():
                raise ValueError(f"{p}: shard named by {index.name} is missing")
            _merge(tensors, read_safetensors_header(p))
        missing = [k for k, shard in weight_map.items()
                   if k not in tensors or Path(tensors[k].path).name != Path(shard).name]
        if missing:
            raise ValueError(f"{index}: {len(missing)} tensors not found in the shard the index names "
                             f"(first: {missing[0]!r})")
        return tensors
    tensors = {}
    for p in sorted(root.glob("*.safetensors")):
        _merge(tensors, read_safetensors_header(p))
    return tensors


def _merge(into: dict[str, TensorInfo], new: dict[str, TensorInfo]) -> None:
    for k, v in new.items():
        if k in into:
            raise ValueError(f"tensor {k!r} is in both {into[k].path} and {v.path}")
        into[k] = v


# ----------------------------------------------------------------------------------------------------
# configs

def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read {what} ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} is not a JSON object")
    return data


def text_config(config: dict) -> dict:
    """The config that describes the language model.

    Plain causal-LM configs are returned as they are. Composite configs (e.g.
    Qwen3_5ForConditionalGeneration) keep the language model under "text_config": its keys are merged
    over the top-level keys (so top-level "architectures", "quantization_config", ... stay visible, and
    the text model's own values win), without the vision/audio sub-configs.
    """
    sub = config.get("text_config")
    if not isinstance(sub, dict):
        return config
    merged = {k: v for k, v in config.items()
              if k not in ("text_config", "vision_config", "audio_config")}
    merged.update(sub)
    return merged


def packaged_configs() -> list[str]:
    """Names of the configs shipped with the package (usable with load_format="dummy")."""
    return sorted(p.name[:-len(".json")] for p in CONFIG_DIR.glob("*.json")
                  if not p.name.endswith(".generation_config.json"))


def _packaged_name(model: str) -> str | None:
    key = model.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in packaged_configs() else None


def packaged_name(model: str | os.PathLike, load_format: str = "auto") -> str | None:
    """The packaged config that resolve(model, load_format) takes, or None (a folder or a hub id)."""
    model = os.fspath(model)
    if Path(model).expanduser().exists():
        return None
    name = _packaged_name(model)
    return name if name is not None and (load_format == "dummy" or "/" not in model) else None


def _load_packaged(name: str) -> ModelFiles:
    config = _read_json(CONFIG_DIR / f"{name}.json", "packaged config")
    gpath = CONFIG_DIR / f"{name}.generation_config.json"
    gen = _read_json(gpath, "packaged generation config") if gpath.is_file() else {}
    return ModelFiles(root=None, config=config, generation_config=gen, tensors={}, name=name)


def _load_folder(root: Path, load_format: str, name: str | None = None) -> ModelFiles:
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{root}: no config.json, not a model folder")
    config = _read_json(cfg_path, "config.json")
    gpath = root / "generation_config.json"
    gen = _read_json(gpath, "generation_config.json") if gpath.is_file() else {}
    # Random weights read none (a hub download with them left out has an index naming absent shards).
    tensors = {} if load_format == "dummy" else _read_weights(root)
    if not tensors and load_format != "dummy":
        raise ValueError(f"{root}: no safetensors weights (model.safetensors, model.safetensors.index.json "
                         f"or *.safetensors); use load_format='dummy' for random weights")
    return ModelFiles(root=root, config=config, generation_config=gen, tensors=tensors,
                      name=name or root.name)


def _looks_like_path(s: str) -> bool:
    return (s.startswith(("/", "./", "../", "~", "\\")) or s in (".", "..") or s.count("/") > 1
            or (os.sep != "/" and os.sep in s) or (len(s) > 1 and s[1] == ":"))


def _download(repo_id: str, revision: str | None, load_format: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise ValueError(f"{repo_id!r} is not a local folder and huggingface_hub is not installed") from e
    def fetch(patterns: list[str], ignore: list[str] | None = None) -> Path:
        try:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                          ignore_patterns=ignore))
        except Exception as e:  # repo not found, gated, offline with nothing cached, network errors, bad ids
            kind = type(e).__name__
            hint = ""
            offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")  # as the hub reads it
            if "LocalEntryNotFound" in kind or "Offline" in kind or offline:
                hint = " (offline and not in the local cache?)"
            raise ValueError(f"model {repo_id!r}: not a local folder, and fetching it from the Hugging Face Hub "
                             f"failed{hint}: {kind}: {e}") from e

    path = fetch(list(_HUB_PATTERNS_META))
    if load_format != "dummy":
        # Only the weights that are read (a repo may hold other copies of them, under other names or in subfolders
        # such as original/): the shards the index names; else model.safetensors; else the top-level files.
        shards = _weight_files(path / "model.safetensors.index.json")
        if shards:
            fetch(shards)
        elif not (fetch(["model.safetensors"]) / "model.safetensors").is_file():
            fetch(["*.safetensors"], ignore=["*/*"])
    return path


def _weight_files(index: Path) -> list[str]:
    """The shard files an index names ([] without a readable index: resolve() says what is wrong)."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def resolve(model: str | os.PathLike, load_format: str = "auto", revision: str | None = None) -> ModelFiles:
    """Finds a model's config and weights.

    model: a local folder; a packaged config name ("qwen3-8b", see packaged_configs(); with
    load_format="dummy" also hub-style names such as "Qwen/Qwen3-8B" that match one); or a hub id,
    downloaded with huggingface_hub (weights left out when load_format="dummy").
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise TypeError(f"model must be a str or os.PathLike, got {type(model).__name__}")
    if not model.strip():
        raise ValueError("model is empty")

    local = Path(model).expanduser()
    if local.is_dir():
        return _load_folder(local, load_format)
    if local.exists():
        raise ValueError(f"{model!r} is a file, not a model folder")

    packaged = packaged_name(model, load_format)
    if packaged is not None:
        if load_format != "dummy":
            raise ValueError(f"{model!r} is a packaged config without weights: use load_format='dummy'")
        return _load_packaged(packaged)

    if _looks_like_path(model):
        raise ValueError(f"{model!r}: no such folder")
    if "/" not in model and (load_format == "dummy" or _QWEN_SIZE_NAME.match(model)):
        raise ValueError(f"{model!r} is not a packaged config ({', '.join(packaged_configs())}), a local folder "
                         "or a Hugging Face Hub id (owner/name, such as 'Qwen/Qwen3-8B')")
    root = _download(model, revision, load_format)
    return _load_folder(root, load_format, name=model)
