"""Finding a model's files: a local folder, a Hugging Face Hub id, or a packaged config name.

`resolve()` returns the parsed config.json, generation_config.json and where every tensor lies in
its safetensors file (read from the headers by hand: no torch, no weights read). This is the one layer that checks
file structure: every file read lies inside the model's folder and is a regular file (model_file), and a
safetensors header is held to the format as the reference `safetensors` library enforces it.
"""
from __future__ import annotations

import json
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TensorInfo", "ModelFiles", "resolve", "text_config", "packaged_configs", "packaged_name",
           "read_safetensors_header", "model_file", "read_model_file", "parse_json"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# Bits per element of every safetensors dtype (the reference library's list; others are refused).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
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

_MAX_HEADER = 100_000_000  # the safetensors format's own limit
_MAX_JSON = 64 << 20  # config / index / tokenizer_config files (a 1 M-entry weight map is ~60 MB)


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

def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def parse_json(raw: bytes | str, where: str, constants: bool = True):
    """JSON without duplicate keys (which value was meant?), any nesting; ValueError naming `where` when it is not.
    constants=False: NaN and Infinity are refused too (the safetensors format's JSON has none)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=None if constants else _reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{where}: not valid JSON ({type(e).__name__}: {e})"[:500]) from None


def _open_regular(path: Path) -> int:
    """A descriptor of path opened for reading; ValueError unless it is a regular file (opened non-blocking: a
    FIFO never hangs it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: not a regular file")
    return fd


def _usize(v) -> bool:
    """An integer the reference library takes as a usize (floats such as 4.0 are not)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Parses one safetensors file's header, as strictly as the reference library: header length at most 1e8,
    UTF-8 JSON object; __metadata__ a map of strings; every tensor a known dtype, a shape and data_offsets of
    unsigned integers whose size matches, the tensors tiling the data bytes exactly (no gap, overlap or
    trailing byte). Duplicate keys are refused too (the reference keeps the last). ValueError naming the file."""
    path = Path(path)
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {len(head)} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path}: corrupt safetensors header (header length {n}, file size {size})")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    finally:
        os.close(fd)
    if len(raw) != n:
        raise ValueError(f"{path}: truncated safetensors header")
    header = parse_json(raw, f"{path}: safetensors header", constants=False)
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")

    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            out[name] = _tensor_info(path, name, entry, data_start)
    # The tensors, in offset order, cover the data bytes exactly once.
    end = 0
    for t in sorted(out.values(), key=lambda t: (t.offset, t.nbytes)):
        if t.offset - data_start != end:
            raise ValueError(f"{path}: tensor {t.name!r} begins at data byte {t.offset - data_start}, expected {end} "
                             "(overlapping or gapped data_offsets): corrupt file")
        end += t.nbytes
    if data_start + end != size:
        raise ValueError(f"{path}: the tensors cover {end} data bytes of {size - data_start}: truncated or corrupt "
                         "file")
    return out


def _tensor_info(path: Path, name: str, entry, data_start: int) -> TensorInfo:
    """One header entry, checked: ValueError naming the file and the tensor."""
    def bad(why: str):
        return ValueError(f"{path}: corrupt safetensors header entry for {name!r} ({why})")

    if not isinstance(entry, dict):
        raise bad("not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise bad(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BITS)}")
    if not (isinstance(shape, list) and all(_usize(d) for d in shape)):
        raise bad(f"shape must be a list of unsigned integers, got {shape!r}"[:300])
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_usize(o) for o in offsets)):
        raise bad(f"data_offsets must be two unsigned integers, got {offsets!r}"[:300])
    begin, end = offsets
    elements = 1
    for d in shape:
        elements *= d
        if elements >= 2**64:
            raise bad(f"shape {shape} overflows")
    bits = elements * DTYPE_BITS[dtype]
    if bits >= 2**64 or bits % 8:
        raise bad(f"shape {shape} of {dtype} is not a whole number of bytes")
    if end < begin or end - begin != bits // 8:
        raise bad(f"data_offsets [{begin}, {end}] hold {end - begin} bytes, {dtype}{shape} needs {bits // 8}")
    if any(d >= 2**63 for d in shape):
        raise bad(f"shape {shape} has a dimension of 2**63 or more")
    return TensorInfo(name=name, path=str(path), offset=data_start + begin, nbytes=end - begin, dtype=dtype,
                      shape=tuple(shape))


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


# ----------------------------------------------------------------------------------------------------
# files inside the model's folder

def _boundary(root: Path) -> Path:
    """The folder no file of root may resolve outside of: root itself, or for a Hugging Face cache snapshot
    (<repo>/snapshots/<revision>, whose files link to <repo>/blobs/) the repo's cache folder."""
    root = Path(os.path.realpath(root))
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        return root.parent.parent
    return root


def model_file(root: Path, name: str) -> Path | None:
    """root/name when it is a regular file inside the model's folder; None when there is no such file. ValueError
    when name is absolute or has a '..' part, when the path resolves (symlinks followed) outside the folder, or
    when it is not a regular file (a FIFO would block its read)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"{root}: bad file name {name!r}")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or name.startswith(("/", "\\")):
        raise ValueError(f"{root}: file name {name!r} leaves the model folder")
    path = root / rel
    if not os.path.lexists(path):
        return None
    resolved = Path(os.path.realpath(path))  # (a symlink loop resolves to a path that does not exist)
    if not resolved.is_relative_to(_boundary(root)):
        raise ValueError(f"{path} resolves to {resolved}, outside the model folder")
    try:
        mode = resolved.stat().st_mode
    except OSError:  # a dangling link or a loop: no such file
        return None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: not a regular file")
    return path


def read_model_file(root: Path, name: str, limit: int = _MAX_JSON) -> bytes | None:
    """The bytes of model_file(root, name) (None when absent); ValueError past `limit` bytes."""
    path = model_file(root, name)
    if path is None:
        return None
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"{path}: {size} bytes, more than the {limit} read")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)[:limit]
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    finally:
        os.close(fd)


def _read_weights(root: Path) -> dict[str, TensorInfo]:
    single = model_file(root, "model.safetensors")
    if single is not None:
        return read_safetensors_header(single)
    index_raw = read_model_file(root, "model.safetensors.index.json")
    if index_raw is not None:
        index = root / "model.safetensors.index.json"
        data = parse_json(index_raw, str(index))
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: corrupt index (weight_map is not an object of file names)")
        shards = sorted(set(weight_map.values()))
        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            p = model_file(root, shard)
            if p is None:
                raise ValueError(f"{root / shard}: shard named by {index.name} is missing")
            _merge(tensors, read_safetensors_header(p))
        missing = [k for k, shard in weight_map.items()
                   if k not in tensors or Path(tensors[k].path).name != Path(shard).name]
        if missing:
            raise ValueError(f"{index}: {len(missing)} tensors not found in the shard the index names "
                             f"(first: {missing[0]!r})")
        return tensors
    tensors = {}
    for p in sorted(root.glob("*.safetensors")):
        _merge(tensors, read_safetensors_header(model_file(root, p.name) or p))
    return tensors


def _merge(into: dict[str, TensorInfo], new: dict[str, TensorInfo]) -> None:
    for k, v in new.items():
        if k in into:
            raise ValueError(f"tensor {k!r} is in both {into[k].path} and {v.path}")
        into[k] = v


# ----------------------------------------------------------------------------------------------------
# configs

def _read_json(path: Path, what: str) -> dict:
    """A JSON object file (packaged configs, or model_file-checked ones); ValueError naming the file."""
    raw = read_model_file(path.parent, path.name)
    if raw is None:
        raise ValueError(f"{path}: no {what}")
    data = parse_json(raw, f"{path}: {what}")
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
    if model_file(root, "config.json") is None:
        raise ValueError(f"{root}: no config.json, not a model folder")
    config = _read_json(root / "config.json", "config.json")
    gen = _read_json(root / "generation_config.json", "generation_config.json") \
        if model_file(root, "generation_config.json") else {}
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
        return sorted(set(parse_json(read_model_file(index.parent, index.name) or b"", str(index))["weight_map"]
                          .values()))
    except (ValueError, KeyError, TypeError, AttributeError):
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
