import json
import struct

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from qwen_rt import model_files
from qwen_rt.model_files import read_safetensors_header, resolve, text_config

SAFETENSORS_DTYPES = {np.float32: "F32", np.float16: "F16", np.int64: "I64", np.int32: "I32",
                      np.uint8: "U8", np.int8: "I8", np.float64: "F64", np.bool_: "BOOL"}


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((7, 5)).astype(np.float32),
        "a.f16": rng.standard_normal((3, 4, 2)).astype(np.float16),
        "b.i64": rng.integers(-5, 5, size=(6,)).astype(np.int64),
        "c.i32": rng.integers(-5, 5, size=(2, 3)).astype(np.int32),
        "d.u8": rng.integers(0, 255, size=(9,)).astype(np.uint8),
        "e.i8": rng.integers(-9, 9, size=(1, 1, 3)).astype(np.int8),
        "f.f64": rng.standard_normal((2,)).astype(np.float64),
        "g.bool": rng.integers(0, 2, size=(4,)).astype(np.bool_),
        "h.scalar": np.array(3.5, dtype=np.float32),
        "i.empty": np.zeros((0, 4), dtype=np.float32),
    }


def _check_against_safetensors(path, infos, arrays):
    raw = path.read_bytes()
    with safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(infos)
        for name in f.keys():
            ref = f.get_tensor(name)
            info = infos[name]
            assert info.name == name and info.path == str(path)
            assert info.shape == tuple(ref.shape)
            assert info.dtype == SAFETENSORS_DTYPES[ref.dtype.type]
            assert info.nbytes == ref.nbytes
            got = np.frombuffer(raw[info.offset:info.offset + info.nbytes], dtype=ref.dtype).reshape(ref.shape)
            np.testing.assert_array_equal(got, ref)
            np.testing.assert_array_equal(got, arrays[name])


def test_header_matches_safetensors(tmp_path):
    arrays = _arrays()
    p = tmp_path / "model.safetensors"
    save_file(arrays, str(p), metadata={"format": "np"})
    infos = read_safetensors_header(p)
    assert "__metadata__" not in infos
    _check_against_safetensors(p, infos, arrays)


def test_header_torch_bf16_and_fp8(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "w.f8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "w.scale_inv": torch.rand(1, 1, generator=g),
        "w.f16": torch.randn(2, 2, generator=g).half(),
    }
    p = tmp_path / "m.safetensors"
    save_torch(tensors, str(p))
    infos = read_safetensors_header(p)
    raw = p.read_bytes()
    expect_dtype = {"w.bf16": "BF16", "w.f8": "F8_E4M3", "w.scale_inv": "F32", "w.f16": "F16"}
    for name, t in tensors.items():
        info = infos[name]
        assert info.dtype == expect_dtype[name]
        assert info.shape == tuple(t.shape)
        assert info.nbytes == t.numel() * t.element_size()
        got = torch.frombuffer(bytearray(raw[info.offset:info.offset + info.nbytes]), dtype=t.dtype).reshape(t.shape)
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def _write_config(d, **extra):
    cfg = {"model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 1, **extra}
    (d / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_resolve_single_file_folder(tmp_path):
    cfg = _write_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": [1, 2]}))
    arrays = _arrays()
    save_file(arrays, str(tmp_path / "model.safetensors"))
    mf = resolve(tmp_path)
    assert mf.root == tmp_path and mf.config == cfg and mf.name == tmp_path.name
    assert mf.generation_config == {"temperature": 0.6, "eos_token_id": [1, 2]}
    _check_against_safetensors(tmp_path / "model.safetensors", mf.tensors, arrays)
    assert resolve(str(tmp_path)).tensors == mf.tensors


def test_resolve_sharded_index(tmp_path):
    _write_config(tmp_path)
    arrays = _arrays()
    names = sorted(arrays)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    weight_map = {}
    for fn, keys in shards.items():
        save_file({k: arrays[k] for k in keys}, str(tmp_path / fn))
        weight_map.update({k: fn for k in keys})
    # a stray file the index does not name must be ignored
    save_file({"stray": np.zeros(2, np.float32)}, str(tmp_path / "extra.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    mf = resolve(tmp_path)
    assert set(mf.tensors) == set(arrays)
    for fn, keys in shards.items():
        sub = {k: mf.tensors[k] for k in keys}
        _check_against_safetensors(tmp_path / fn, sub, arrays)
    assert mf.generation_config == {}


def test_missing_shard(tmp_path):
    _write_config(tmp_path)
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(ValueError, match="s2.safetensors"):
        resolve(tmp_path)


def test_index_with_a_file_name_that_is_not_a_string(tmp_path):
    _write_config(tmp_path)
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "w-1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5}}))
    with pytest.raises(ValueError, match="corrupt index"):
        resolve(tmp_path)


def test_index_names_tensor_not_in_shard(tmp_path):
    _write_config(tmp_path)
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(ValueError, match="'b'"):
        resolve(tmp_path)


def test_glob_of_safetensors_files(tmp_path):
    _write_config(tmp_path)
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "x.safetensors"))
    save_file({"b": np.ones(2, np.int64)}, str(tmp_path / "y.safetensors"))
    mf = resolve(tmp_path)
    assert set(mf.tensors) == {"a", "b"}
    assert mf.tensors["b"].path.endswith("y.safetensors")


def test_duplicate_tensor_across_files(tmp_path):
    _write_config(tmp_path)
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "x.safetensors"))
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(ValueError, match="'a'"):
        resolve(tmp_path)


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_header", "tiny", "bad_json", "huge_len",
                                    "wrong_nbytes", "shape_str", "shape_float", "offsets_inf", "offsets_huge"])
def test_corrupt_file(tmp_path, damage):
    _write_config(tmp_path)
    p = tmp_path / "model.safetensors"
    save_file({"a": np.arange(64, dtype=np.float32), "b": np.ones((4, 4), np.float16)}, str(p))
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "truncate_data":
        raw = raw[:-10]
    elif damage == "truncate_header":
        raw = raw[: 8 + n // 2]
    elif damage == "tiny":
        raw = raw[:5]
    elif damage == "bad_json":
        raw = raw[:8] + b"{" * n + raw[8 + n:]
    elif damage == "huge_len":
        raw = struct.pack("<Q", 1 << 40) + raw[8:]
    else:  # a header whose values are not what the format allows (JSON numbers that are not integers, strings)
        header = json.loads(raw[8:8 + n])
        a = header["a"]
        if damage == "wrong_nbytes":
            a["shape"] = [65]
        elif damage == "shape_str":
            a["shape"] = "64"
        elif damage == "shape_float":
            a["shape"] = [64.0]
        elif damage == "offsets_inf":
            a["data_offsets"] = [0, float("inf")]
        else:
            a["data_offsets"] = [0, 1e400]
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        raw = struct.pack("<Q", len(h)) + h + raw[8 + n:]
    p.write_bytes(raw)
    with pytest.raises(ValueError, match="model.safetensors"):
        resolve(tmp_path)


def test_missing_config(tmp_path):
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="config.json"):
        resolve(tmp_path)


def test_no_weights(tmp_path):
    cfg = _write_config(tmp_path)
    with pytest.raises(ValueError, match="no safetensors"):
        resolve(tmp_path)
    mf = resolve(tmp_path, load_format="dummy")
    assert mf.config == cfg and mf.tensors == {}


def test_missing_folder_path():
    with pytest.raises(ValueError, match="no such folder"):
        resolve("./definitely/not/here")


def test_bad_load_format(tmp_path):
    with pytest.raises(ValueError):
        resolve(tmp_path, load_format="pt")


# -- packaged configs ---------------------------------------------------------------------------------

FACTS = {
    # name: (model_type, hidden, layers, q heads, kv heads, inter, vocab, tied, head_dim, max_pos)
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 3072, 151936, True, 128, 40960),
    "qwen3-8b": ("qwen3", 4096, 36, 32, 8, 12288, 151936, False, 128, 40960),
    "qwen3-32b": ("qwen3", 5120, 64, 64, 8, 25600, 151936, False, 128, 40960),
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 18944, 152064, False, None, 32768),
}


def test_packaged_names():
    assert set(FACTS) <= set(model_files.packaged_configs())


@pytest.mark.parametrize("name", sorted(FACTS))
def test_packaged_config_facts(name):
    mt, hidden, layers, heads, kv, inter, vocab, tied, head_dim, max_pos = FACTS[name]
    for spelling in (name, name.upper()):
        mf = resolve(spelling, load_format="dummy")
        c = mf.config
        assert mf.root is None and mf.tensors == {} and mf.name == name
        assert c["model_type"] == mt
        assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
                c["intermediate_size"], c["vocab_size"], c["tie_word_embeddings"]) == (
                    hidden, layers, heads, kv, inter, vocab, tied)
        assert c.get("head_dim") == head_dim
        assert c["max_position_embeddings"] == max_pos
        assert c["rope_theta"] == 1e6 and c["rms_norm_eps"] == 1e-6
        assert c["hidden_act"] == "silu"
        if mt == "qwen3":
            assert c["attention_bias"] is False and c["eos_token_id"] == 151645
        g = mf.generation_config
        assert g["eos_token_id"] == [151645, 151643]
        if mt == "qwen3":
            assert (g["temperature"], g["top_p"], g["top_k"]) == (0.6, 0.95, 20)


@pytest.mark.parametrize("hub_id,name", [("Qwen/Qwen3-8B", "qwen3-8b"), ("Qwen/Qwen3-0.6B", "qwen3-0.6b"),
                                         ("qwen/qwen3-32b", "qwen3-32b"), ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b")])
def test_hub_style_names_dummy(hub_id, name, monkeypatch):
    def no_download(*a, **k):
        raise AssertionError("must not download")
    monkeypatch.setattr(model_files, "_download", no_download)
    mf = resolve(hub_id, load_format="dummy")
    assert mf.name == name and mf.config == resolve(name, load_format="dummy").config


def test_packaged_needs_dummy():
    with pytest.raises(ValueError, match="dummy"):
        resolve("qwen3-8b")


@pytest.mark.parametrize("model,load_format", [("qwen3-4b", "dummy"), ("qwen3-4b", "auto"),
                                               ("Qwen2.5-7B-Instruct-1M", "auto"), ("llama-7b", "dummy")])
def test_an_unknown_packaged_name_lists_the_packaged_configs(model, load_format, monkeypatch):
    """A name without an owner that is not packaged never reaches the Hub: the error lists what is packaged."""
    monkeypatch.setattr(model_files, "_download", lambda *a: pytest.fail("the Hub was asked"))
    with pytest.raises(ValueError, match="not a packaged config") as e:
        resolve(model, load_format=load_format)
    assert all(name in str(e.value) for name in model_files.packaged_configs())


def test_local_folder_wins_over_packaged_name(tmp_path, monkeypatch):
    d = tmp_path / "qwen3-8b"
    d.mkdir()
    cfg = _write_config(d)
    monkeypatch.chdir(tmp_path)
    mf = resolve("qwen3-8b", load_format="dummy")
    assert mf.config == cfg and mf.root is not None


def test_hub_errors_become_value_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"), raising=False)
    with pytest.raises(ValueError, match="someone/not-a-model"):
        resolve("someone/not-a-model")


def test_hub_download_patterns(monkeypatch, tmp_path):
    calls = []
    snap = tmp_path / "snap"
    snap.mkdir()
    _write_config(snap)
    save_file({"a": np.ones(3, np.float32)}, str(snap / "model.safetensors"))

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        calls.append((repo_id, revision, list(allow_patterns), ignore_patterns))
        return str(snap)

    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    mf = resolve("org/model", revision="abc")
    assert mf.name == "org/model" and set(mf.tensors) == {"a"}
    # First the metadata (with the index, if any), then the weights: without an index, the safetensors files.
    assert calls[-2][:2] == ("org/model", "abc") and calls[-1][:2] == ("org/model", "abc")
    assert "tokenizer.json" in calls[-2][2] and "config.json" in calls[-2][2]
    assert "additional_chat_templates/*.jinja" in calls[-2][2]  # named templates (tool_use), as from_dir reads
    assert "model.safetensors.index.json" in calls[-2][2] and not any(p.endswith(".safetensors") for p in calls[-2][2])
    assert calls[-1][2] == ["model.safetensors"]  # the file read, not every other copy of the weights
    # Without an index or model.safetensors: the top-level safetensors files (not subfolders' copies).
    (snap / "model.safetensors").rename(snap / "weights.safetensors")
    n = len(calls)
    mf = resolve("org/model")
    assert set(mf.tensors) == {"a"} and len(calls) == n + 3
    assert calls[-2][2] == ["model.safetensors"] and calls[-1][2] == ["*.safetensors"] and calls[-1][3] == ["*/*"]
    (snap / "weights.safetensors").rename(snap / "model.safetensors")
    # With an index: exactly the shards it names (a repo's other copies of the weights are not fetched).
    (snap / "model.safetensors").rename(snap / "w-00001.safetensors")
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "w-00001.safetensors"}}))
    n = len(calls)
    mf = resolve("org/model")
    assert set(mf.tensors) == {"a"} and len(calls) == n + 2 and calls[-1][2] == ["w-00001.safetensors"]
    assert calls[-1][3] is None
    n = len(calls)
    (snap / "w-00001.safetensors").unlink()  # random weights: the shards the index names are neither fetched nor read
    mf = resolve("org/model", load_format="dummy")
    assert len(calls) == n + 1 and not any(p.endswith(".safetensors") for p in calls[-1][2]) and mf.tensors == {}


def test_text_config():
    plain = {"model_type": "qwen3", "hidden_size": 4}
    assert text_config(plain) is plain
    composite = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                 "tie_word_embeddings": False, "quantization_config": {"quant_method": "fp8"},
                 "vision_config": {"depth": 2},
                 "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64}}
    t = text_config(composite)
    assert t["model_type"] == "qwen3_5_text" and t["hidden_size"] == 5120 and t["num_hidden_layers"] == 64
    assert t["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert t["quantization_config"] == {"quant_method": "fp8"} and t["tie_word_embeddings"] is False
    assert "vision_config" not in t and "text_config" not in t


def test_native_config_defaults_and_refusals():
    """What config.json does not say is taken as transformers takes it; what the engine cannot run as the config
    says (quantized weights, a sliding window shorter than the context) is a ValueError naming it."""
    from qwen_rt.config import native_config
    base = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 1024}
    assert native_config(base).head_dim == 128  # Qwen3Config's default, not hidden_size / heads
    assert native_config(dict(base, model_type="qwen2")).head_dim == 64
    # num_key_value_heads: absent is transformers' default (32), null is one per q head.
    no_kv = {k: v for k, v in base.items() if k != "num_key_value_heads"}
    assert native_config(dict(no_kv, num_attention_heads=64)).num_kv_heads == 32
    assert native_config(dict(base, num_key_value_heads=None)).num_kv_heads == 4
    assert native_config(base).max_position_embeddings == 1024
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert native_config(dict(base, rope_scaling=yarn)).max_position_embeddings == 4096  # Qwen's long-context recipe
    for bad, needle in (({"quantization_config": {"quant_method": "fp8"}}, "fp8"),
                        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "awq"),
                        ({"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 0}, "sliding"),
                        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 256}, "sliding")):
        with pytest.raises(ValueError, match=needle):
            native_config(dict(base, **bad))
    # Windows that never bind: no layer uses one, or it covers the whole context.
    with pytest.raises(ValueError, match="sliding"):  # transformers' default window (4096) binds at 8192
        native_config(dict(base, use_sliding_window=True, max_window_layers=0, max_position_embeddings=8192))
    for bad, needle in (({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                        ({"attention_bias": True}, "attention_bias"),
                        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
                        ({"rope_scaling": "yarn"}, "rope_scaling must be an object"),
                        ({"rope_theta": -1.0}, "rope_theta"),
                        ({"rms_norm_eps": "small"}, "rms_norm_eps"),
                        ({"architectures": "LlamaForCausalLM"}, "'LlamaForCausalLM'")):
        with pytest.raises(ValueError, match=needle):
            native_config(dict(base, **bad))
    # Null values take transformers' defaults; Qwen2's q/k/v biases stand whatever attention_bias says.
    assert native_config(dict(base, rms_norm_eps=None, rope_theta=None, hidden_act="silu")).rms_eps == pytest.approx(1e-6)
    assert native_config(dict(base, model_type="qwen2", attention_bias=False)).attn_bias
    for ok in ({"use_sliding_window": False, "sliding_window": 256},
               {"use_sliding_window": True, "sliding_window": 256, "max_window_layers": 2},
               {"use_sliding_window": True, "sliding_window": 256},  # max_window_layers' default (28): no layer
               {"use_sliding_window": True, "sliding_window": 4096}):
        native_config(dict(base, **ok))


# --- no read leaves the model folder; no file blocks the load ---------------------------------------------------

def _outside_file(tmp_path):
    """A valid safetensors file outside the model folder tmp_path/m (which is returned, with a config)."""
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "outside.safetensors"))
    m = tmp_path / "m"
    m.mkdir()
    _write_config(m)
    return m


@pytest.mark.parametrize("name", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS", "/etc/passwd"])
def test_index_entries_stay_inside_the_folder(tmp_path, name):
    m = _outside_file(tmp_path)
    if name == "ABS":
        name = str(tmp_path / "outside.safetensors")
    (m / "sub").mkdir()
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": name}}))
    with pytest.raises(ValueError, match="leaves the model folder"):
        resolve(m)


@pytest.mark.parametrize("link", ["model.safetensors", "w.safetensors", "shard.safetensors", "config.json",
                                  "generation_config.json"])
def test_symlinks_out_of_the_folder_are_refused(tmp_path, link):
    m = _outside_file(tmp_path)
    if link == "shard.safetensors":
        (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": link}}))
    if link.endswith(".json"):
        save_file({"a": np.ones(3, np.float32)}, str(m / "model.safetensors"))
        (tmp_path / "outside.json").write_text("{}")
        (m / link).unlink(missing_ok=True)
        (m / link).symlink_to(tmp_path / "outside.json")
    else:
        (m / link).symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ValueError, match="outside the model folder"):
        resolve(m)


def test_symlinks_inside_the_folder_and_into_a_hub_cache_are_followed(tmp_path):
    # A Hugging Face cache: <repo>/snapshots/<rev>/<file> links to <repo>/blobs/<hash>.
    repo = tmp_path / "models--Qwen--X"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    save_file({"a": np.ones(3, np.float32)}, str(repo / "blobs" / "h1"))
    (repo / "blobs" / "h2").write_text(json.dumps({"model_type": "qwen3"}))
    (snap / "model.safetensors").symlink_to("../../blobs/h1")
    (snap / "config.json").symlink_to("../../blobs/h2")
    mf = resolve(snap)
    assert set(mf.tensors) == {"a"} and mf.config == {"model_type": "qwen3"}
    # Inside a plain folder: a link to a file of its own.
    m = tmp_path / "plain"
    m.mkdir()
    _write_config(m)
    save_file({"a": np.ones(3, np.float32)}, str(m / "real.bin"))
    (m / "model.safetensors").symlink_to("real.bin")
    assert set(resolve(m).tensors) == {"a"}


@pytest.mark.parametrize("name", ["model.safetensors", "x.safetensors", "config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_a_fifo_never_blocks_the_load(tmp_path, name):
    """A FIFO under a name the loader reads blocked it forever: refused, at once."""
    import os
    import threading
    _write_config(tmp_path)
    if name != "x.safetensors" and name != "model.safetensors":
        save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
    if name == "model.safetensors.index.json":
        (tmp_path / "model.safetensors").unlink()
    if name == "config.json":
        (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    result = []
    t = threading.Thread(target=lambda: result.append(_raises(lambda: resolve(tmp_path))), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "resolve() blocked on a FIFO"
    assert result and isinstance(result[0], ValueError) and "not a regular file" in str(result[0]), result


def _raises(fn):
    try:
        fn()
    except Exception as e:
        return e
    return None


# --- the safetensors format, as strictly as the reference library -------------------------------------------------

def _raw_file(tmp_path, header: bytes | dict, data: bytes):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    p = tmp_path / "t.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return p


def _entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("case,header,data,match", [
    ("overlap", {"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [4], 2, 6)}, 6, "overlapping or gapped"),
    ("gap", {"a": _entry("U8", [4], 0, 4), "b": _entry("U8", [4], 6, 10)}, 10, "overlapping or gapped"),
    ("trailing", {"a": _entry("U8", [4], 0, 4)}, 6, "cover 4 data bytes of 6"),
    ("dtype-name", {"a": _entry("float32", [1], 0, 4)}, 4, "dtype 'float32' is not one of"),
    ("huge-dims", {"a": _entry("U8", [2**63, 2, 0], 0, 0)}, 0, "overflows"),
    ("dim-2^63", {"a": _entry("U8", [2**63, 0], 0, 0)}, 0, "2\\*\\*63"),
    ("sub-byte", {"a": _entry("F4", [3], 0, 2)}, 2, "whole number of bytes"),
    ("metadata", {"__metadata__": {"format": 1}, "a": _entry("U8", [4], 0, 4)}, 4, "__metadata__"),
    ("duplicate", b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"a":{"dtype":"U8","shape":[4],'
                  b'"data_offsets":[0,4]}}', 4, "duplicate key 'a'"),
    ("nan", b'{"__metadata__":{"a":NaN}}', 0, "not valid JSON"),
    ("deep", b'{"x":' + b"[" * 100000 + b"]" * 100000 + b"}", 0, "not valid JSON|not an object"),
])
def test_format_violations_are_refused(tmp_path, case, header, data, match):
    p = _raw_file(tmp_path, header, b"\0" * data)
    with pytest.raises(ValueError, match=match):
        read_safetensors_header(p)
    if case not in ("duplicate", "dim-2^63"):  # the reference keeps the last of duplicate keys and takes any usize
        with pytest.raises(Exception):
            with safe_open(str(p), framework="numpy") as f:
                list(f.keys())


def test_every_dtype_of_the_format_is_read(tmp_path):
    header, off = {}, 0
    for i, (dt, bits) in enumerate(model_files.DTYPE_BITS.items()):
        n = (16 // bits + 1) * 8 if bits < 8 else 3
        size = n * bits // 8
        header[f"t{i}"] = _entry(dt, [n], off, off + size)
        off += size
    p = _raw_file(tmp_path, header, b"\0" * off)
    infos = read_safetensors_header(p)
    with safe_open(str(p), framework="numpy") as f:
        assert set(f.keys()) == set(infos)
    assert {i.dtype for i in infos.values()} == set(model_files.DTYPE_BITS)
