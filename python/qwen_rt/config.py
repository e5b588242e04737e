"""From a Hugging Face config.json to the native ModelConfig: architecture, shapes, RoPE.

This is the one layer that checks config values: every value read goes through config_int / config_number /
config_bool (or _rope_parameters' checks), so a bad one is a ValueError naming its key, before anything divides
by it or hands it to the engine's int32 fields."""
from __future__ import annotations

import math
import re

import numpy as np

from . import _core

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the engine keeps config numbers as float32
MAX_HEAD_DIM = 4096
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5ForConditionalGeneration": "qwen3_5"}
MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}
# Qwen3.5 / 3.6 / 3.8 (model_type qwen3_5): text weights under this prefix in the ForConditionalGeneration layout.
MULTIMODAL_PREFIX = "model.language_model."
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json's architectures must be a list of names, got {archs!r}"[:300])
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if archs:
        raise ValueError(f"unsupported model architecture {archs[0]!r} (supported: {', '.join(ARCHITECTURES)})")
    mt = cfg.get("model_type")
    if isinstance(mt, str) and mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ValueError(f"unsupported model type {mt!r} (supported: {', '.join(ARCHITECTURES)})"[:300])


def _rope_parameters(cfg: dict) -> dict:
    """RoPE settings in transformers 5 form. As there, rope_scaling (the block Qwen's model cards have users add
    for long contexts) replaces rope_parameters when both are present; rope_theta comes from the block, else the
    top level, else rope_parameters (where transformers 5 saves it), else 10000."""
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for key, v in (("rope_scaling", scaling), ("rope_parameters", params)):
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"config.json's {key} must be an object, got {type(v).__name__}")
    p = dict(scaling or params or {})
    p.setdefault("rope_type", p.get("type", "default"))
    if not isinstance(p["rope_type"], str):
        raise ValueError(f"config.json's rope type must be a string, got {p['rope_type']!r}"[:300])
    if p.get("rope_theta") is None:
        p["rope_theta"] = next((t for t in (cfg.get("rope_theta"), (params or {}).get("rope_theta")) if t is not None),
                               10000.0)
    # Every number the RoPE kinds read: positive and finite (a yarn factor of 0, -1 or NaN made NaN logits).
    for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if p.get(key) is not None:
            _number("rope_scaling's ", key, p[key])
    if p.get("original_max_position_embeddings") is not None:
        config_int(p, "original_max_position_embeddings", where="rope_scaling's ")
    return p


def with_rope_scaling(cfg: dict, rope_scaling) -> dict:
    """cfg with rope_scaling's keys over its RoPE settings (Generator(rope_scaling=...)): what Qwen's model cards
    have users write into config.json for contexts beyond max_position_embeddings (yarn), the rest (rope_theta,
    partial_rotary_factor) kept. Checked as config.json's own."""
    if not isinstance(rope_scaling, dict) or not all(isinstance(k, str) for k in rope_scaling):
        raise TypeError(f"rope_scaling must be a dict of str keys, got {type(rope_scaling).__name__}")
    _rope_parameters(cfg)  # the config's own settings first (objects, numbers), with its messages
    merged = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if "type" in rope_scaling or "rope_type" in rope_scaling:  # a new kind: the old one's name goes
        merged.pop("type", None)
        merged.pop("rope_type", None)
    merged.update(rope_scaling)
    out = dict(cfg, rope_scaling=merged)
    _rope_parameters(out)
    return out


def _number(where: str, key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= FLOAT32_MAX:  # (NaN fails too)
        raise ValueError(f"config.json's {where}{key} must be a positive number, got {v!r}"[:300])
    return float(v)


def rotary_dim(cfg: dict, arch: str, head_dim: int) -> int:
    """Dimensions of a head that RoPE rotates: all of them for Qwen2/Qwen3 (transformers' ignore
    partial_rotary_factor), head_dim * partial_rotary_factor (default 0.25) for Qwen3.5."""
    if arch != "qwen3_5":
        return head_dim
    p = _rope_parameters(cfg)
    f = p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    dim = int(head_dim * _number("rope_parameters' ", "partial_rotary_factor", f))
    if not 2 <= dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {f} gives {dim} rotary dimensions of head_dim {head_dim}")
    return dim


def config_int(cfg: dict, key: str, default=None, lo: int = 1, hi: int = INT32_MAX, where: str = "") -> int:
    """cfg[key] (default when absent or null) as an int in [lo, hi]: an integer (not a bool, a fraction or a
    string), or ValueError naming the key."""
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise ValueError(f"config.json lacks {where}{key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"config.json's {where}{key} must be an integer in [{lo}, {hi}], got {v!r}"[:300])
    return v


def config_bool(cfg: dict, key: str, default: bool) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"config.json's {key} must be true or false, got {v!r}"[:300])
    return v


def rope_inv_freq(cfg: dict, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies of the dim rotated dimensions (float32, computed as transformers does) and the
    attention factor."""
    p = _rope_parameters(cfg)
    base = _number("", "rope_theta", p["rope_theta"])
    kind = p["rope_type"]
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return (inv / np.float32(_number("rope_scaling's ", "factor", p.get("factor")))).astype(np.float32), 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope type {kind!r} (supported: default, linear, yarn)")
    max_pos = config_int(cfg, "max_position_embeddings")
    orig = p.get("original_max_position_embeddings") or config_int(cfg, "original_max_position_embeddings", max_pos)
    factor = p.get("factor")
    if factor is None:
        factor = max_pos / orig

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        ms, msa = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = get_mscale(factor, ms) / get_mscale(factor, msa) if ms and msa else get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra = (np.float32(1) - ramp).astype(np.float32)
    inv_interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    out = inv_interp * (np.float32(1) - extra) + inv * extra
    return out.astype(np.float32), float(attention_factor)


def config_dtype(cfg: dict) -> str:
    """The weight dtype config.json names (bfloat16 when it names none or another)."""
    d = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return d if d in FLOAT_DTYPES else "bfloat16"


def context_limit(cfg: dict, max_pos: int) -> int:
    """The longest context the model serves: max_position_embeddings, or with yarn the original length times the
    factor (Qwen's recipe for long contexts: factor 4 over 32768 positions is 131072)."""
    p = _rope_parameters(cfg)
    if p["rope_type"] != "yarn" or not p.get("factor"):
        return max_pos
    orig = p.get("original_max_position_embeddings") or config_int(cfg, "original_max_position_embeddings", max_pos)
    if orig * float(p["factor"]) > INT32_MAX:
        raise ValueError(f"rope_scaling's factor {p['factor']} x {orig} positions exceeds {INT32_MAX}")
    return max(max_pos, int(orig * float(p["factor"])))


def _check_full_attention(cfg: dict, context: int) -> None:
    """Every layer attends to all keys here: a config whose layers use a window shorter than the context is
    refused rather than run differently (official Qwen2/Qwen3 configs set use_sliding_window false)."""
    # Absent keys take transformers' Qwen2/Qwen3 defaults (sliding_window 4096, max_window_layers 28).
    window = config_int(cfg, "sliding_window", 0, lo=0, hi=2**63 - 1) if "sliding_window" in cfg else 4096
    if cfg.get("layer_types") is not None:
        if not isinstance(cfg["layer_types"], list):
            raise ValueError(f"config.json's layer_types must be a list, got {cfg['layer_types']!r}"[:300])
        sliding = "sliding_attention" in cfg["layer_types"]
    else:  # Qwen2's rule: with use_sliding_window, layers from max_window_layers on use the window
        first = config_int(cfg, "max_window_layers", 28, lo=0)
        sliding = config_bool(cfg, "use_sliding_window", False) and first < config_int(cfg, "num_hidden_layers")
    if sliding and window and window < context:
        raise ValueError(f"sliding-window attention (window {window}, use_sliding_window / layer_types) is not "
                         "supported")


QUANTIZATIONS = ("fp8",)
MAX_FP8_LAYERS = 65536  # FP8 modules are matched one by one against modules_to_not_convert / ignore


def fp8_format(cfg: dict) -> tuple[str, str, list] | None:
    """(scale format, scale tensor name, modules kept unquantized) of config.json's quantization_config, None
    without one; ValueError for a quantization the engine cannot run. Qwen's FP8 checkpoints (quant_method fp8,
    e4m3, 128 x 128 blocks, weight_scale_inv) and compressed-tensors FP8 (weight_scale per channel, tensor or
    128 x 128 block) are read; activations are not quantized (weight-only FP8)."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {q!r}"[:300])
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 checkpoints of fmt {q.get('fmt')!r} are not supported (e4m3)"[:300])
        if q.get("weight_block_size") != [128, 128]:
            raise ValueError(f"fp8 checkpoints with weight_block_size {q.get('weight_block_size')!r} are not "
                             "supported (Qwen's [128, 128] blocks)"[:300])
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"fp8 checkpoints with activation_scheme {q.get('activation_scheme')!r} are not "
                             "supported (dynamic)"[:300])
        return "block", "weight_scale_inv", _pattern_list(q, "modules_to_not_convert")
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if q.get("format") != "float-quantized" or not isinstance(groups, dict) or len(groups) != 1:
            raise ValueError(f"compressed-tensors checkpoints of format {q.get('format')!r} are not supported (FP8 "
                             "weights, format float-quantized, one config group)"[:300])
        g = next(iter(groups.values()))
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict) or w.get("type") != "float" or w.get("num_bits") != 8 or g.get("targets") != ["Linear"]:
            raise ValueError(f"compressed-tensors weights {w!r} are not supported (8-bit float, targets "
                             "['Linear'])"[:300])
        strategy = w.get("strategy")
        if strategy == "block" and w.get("block_structure") == [128, 128]:
            strategy = "block"
        elif strategy not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors FP8 weights of strategy {strategy!r} are not supported (channel, "
                             "tensor, block of [128, 128])"[:300])
        if q.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors kv_cache_scheme (an FP8 KV cache) is not supported")
        return strategy, "weight_scale", _pattern_list(q, "ignore")
    raise ValueError(f"quantized checkpoints (quant_method {method!r}) are not supported: FP8 ones (fp8, "
                     "compressed-tensors) are; else use the model's bf16/fp16 release"[:300])


def _pattern_list(q: dict, key: str) -> list:
    v = q.get(key) or []
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise ValueError(f"quantization_config's {key} must be a list of module names, got {v!r}"[:300])
    for p in v:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ValueError(f"quantization_config's {key} holds a bad regular expression {p!r}: {e}"[:300]) from None
    return v


def _name_forms(module: str) -> tuple[str, ...]:
    """A module's name with and without the multimodal layout's prefix (model.language_model. / model.)."""
    if module.startswith(MULTIMODAL_PREFIX):
        return module, "model." + module[len(MULTIMODAL_PREFIX):]
    if module.startswith("model."):
        return module, MULTIMODAL_PREFIX + module[len("model."):]
    return (module,)


def skips_module(pattern: str, module: str) -> bool:
    """Whether a modules_to_not_convert / ignore entry names the module: 're:' and a regular expression matched
    at the start (compressed-tensors), else the module, a module holding it ('model.layers.3') or its last
    components ('in_proj_a', 'linear_attn.in_proj_b'); either name form matches (with or without the
    model.language_model. prefix)."""
    for m in _name_forms(module):
        if pattern.startswith("re:"):
            if re.match(pattern[3:], m):
                return True
        elif m == pattern or m.startswith(pattern + ".") or m.endswith("." + pattern):
            return True
    return False


def set_fp8(c: "_core.ModelConfig", cfg: dict, quantization) -> None:
    """FP8 linears of c (c.weight_prefix set): those of an FP8 checkpoint but what its quantization_config keeps
    unquantized, or with quantization="fp8" on a 16/32-bit checkpoint every decoder projection quantized at load
    but in_proj_a / in_proj_b (as Qwen's FP8 checkpoints keep them)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    fmt = fp8_format(cfg)
    if fmt is None and quantization is None:
        return
    if c.num_layers > MAX_FP8_LAYERS:
        raise ValueError(f"FP8 weights for {c.num_layers} layers: at most {MAX_FP8_LAYERS} are supported")
    modules = _core.linear_modules(c)
    if fmt is None:  # quantized at load
        c.fp8_scales, c.fp8_online = "block", True
        c.fp8_skip = [m for m in modules if m.endswith((".in_proj_a", ".in_proj_b"))]
        return
    c.fp8_scales, c.fp8_scale_name, patterns = fmt
    c.fp8_skip = [m for m in modules if any(skips_module(p, m) for p in patterns)]


def native_config(cfg: dict, weight_prefix: str = "model.", quantization=None) -> "_core.ModelConfig":
    """Checks config.json and converts it; ValueError naming what is missing or unsupported. weight_prefix: where
    the checkpoint keeps the decoder's tensors; quantization: None or "fp8" (quantize the linears at load)."""
    arch = architecture(cfg)
    c = _core.ModelConfig()
    c.arch = arch
    fp8_format(cfg)  # a quantization the engine cannot run is refused first
    c.vocab_size = config_int(cfg, "vocab_size")
    c.hidden_size = config_int(cfg, "hidden_size")
    c.num_layers = config_int(cfg, "num_hidden_layers")
    c.num_q_heads = config_int(cfg, "num_attention_heads")
    # As transformers' Qwen2/Qwen3 configs: an absent key is their default (32), a null one means one per q head.
    c.num_kv_heads = config_int(cfg, "num_key_value_heads", 32 if "num_key_value_heads" not in cfg else c.num_q_heads)
    # transformers' Qwen3Config defaults head_dim to 128, Qwen3.5's to 256; Qwen2's is hidden_size / heads.
    default_head_dim = {"qwen3": 128, "qwen3_5": 256}.get(arch, c.hidden_size // c.num_q_heads)
    c.head_dim = config_int(cfg, "head_dim", default_head_dim, hi=MAX_HEAD_DIM)
    if c.head_dim < 2 or c.head_dim % 2:
        raise ValueError(f"head_dim must be even and at least 2 (config.json's head_dim, or hidden_size / "
                         f"num_attention_heads), got {c.head_dim}")
    c.intermediate_size = config_int(cfg, "intermediate_size")
    for name, n in (("num_attention_heads x head_dim", c.num_q_heads * c.head_dim),
                    ("num_key_value_heads x head_dim", c.num_kv_heads * c.head_dim),
                    ("2 x intermediate_size", 2 * c.intermediate_size)):
        if n > INT32_MAX:  # the engine's int32 row counts
            raise ValueError(f"config.json's {name} is {n}, more than {INT32_MAX}")
    eps = cfg.get("rms_norm_eps")
    c.rms_eps = 1e-6 if eps is None else _number("", "rms_norm_eps", eps)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (the MLP is SwiGLU: silu)")
    if arch in ("qwen3", "qwen3_5") and config_bool(cfg, "attention_bias", False):
        raise ValueError("attention_bias on a Qwen3 model (biases on q/k/v and o_proj) is not supported")
    c.tie_embeddings = config_bool(cfg, "tie_word_embeddings", False)
    c.attn_bias = arch == "qwen2"  # Qwen2: q/k/v biases (o_proj has none)
    c.qk_norm = arch in ("qwen3", "qwen3_5")
    if arch == "qwen3_5":
        _hybrid_fields(cfg, c)
    c.max_position_embeddings = context_limit(cfg, config_int(cfg, "max_position_embeddings"))
    _check_full_attention(cfg, c.max_position_embeddings)
    inv, af = rope_inv_freq(cfg, rotary_dim(cfg, arch, c.head_dim))
    c.rope_inv_freq = [float(x) for x in inv]
    c.rope_attention_factor = af
    c.weight_prefix = weight_prefix
    set_fp8(c, cfg, quantization)
    return c


def _hybrid_fields(cfg: dict, c: "_core.ModelConfig") -> None:
    """Qwen3.5's layer plan (Gated DeltaNet and gated attention layers) and its DeltaNet sizes, with
    transformers' Qwen3_5TextConfig defaults."""
    c.zero_centred_norms = True
    c.attn_output_gate = True
    types = cfg.get("layer_types")
    if types is None:
        interval = config_int(cfg, "full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(c.num_layers)]
    if not isinstance(types, list) or len(types) != c.num_layers or not all(isinstance(t, str) for t in types):
        raise ValueError(f"config.json's layer_types must list a type for each of the {c.num_layers} layers")
    bad = sorted(set(types) - {"full_attention", "linear_attention"})
    if bad:
        raise ValueError(f"layer type {bad[0]!r} is not supported (full_attention, linear_attention)")
    c.layer_types = types
    c.mtp_layers = config_int(cfg, "mtp_num_hidden_layers", 0, lo=0)  # 0: no MTP head
    for field, key, default in (("linear_k_heads", "linear_num_key_heads", 16),
                                ("linear_v_heads", "linear_num_value_heads", 32),
                                ("linear_k_dim", "linear_key_head_dim", 128),
                                ("linear_v_dim", "linear_value_head_dim", 128),
                                ("linear_conv_kernel", "linear_conv_kernel_dim", 4)):
        setattr(c, field, config_int(cfg, key, default, hi=MAX_HEAD_DIM if key.endswith("dim") else INT32_MAX))
