"""From a Hugging Face config.json to the native ModelConfig: architecture, shapes, RoPE."""
from __future__ import annotations

import math

import numpy as np

from . import _core

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
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if archs:
        raise ValueError(f"unsupported model architecture {archs[0]!r} (supported: {', '.join(ARCHITECTURES)})")
    mt = cfg.get("model_type")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ValueError(f"unsupported model type {mt!r} (supported: {', '.join(ARCHITECTURES)})")


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
    if p.get("rope_theta") is None:
        p["rope_theta"] = next((t for t in (cfg.get("rope_theta"), (params or {}).get("rope_theta")) if t is not None),
                               10000.0)
    return p


def _number(where: str, key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"config.json's {where}{key} must be a positive number, got {v!r}")
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
    max_pos = cfg["max_position_embeddings"]
    orig = p.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos
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
    orig = p.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos
    return max(max_pos, int(orig * float(p["factor"])))


def _check_full_attention(cfg: dict, context: int) -> None:
    """Every layer attends to all keys here: a config whose layers use a window shorter than the context is
    refused rather than run differently (official Qwen2/Qwen3 configs set use_sliding_window false)."""
    # Absent keys take transformers' Qwen2/Qwen3 defaults (sliding_window 4096, max_window_layers 28).
    window = cfg["sliding_window"] if "sliding_window" in cfg else 4096
    if cfg.get("layer_types") is not None:
        sliding = "sliding_attention" in cfg["layer_types"]
    else:  # Qwen2's rule: with use_sliding_window, layers from max_window_layers on use the window
        first = cfg["max_window_layers"] if cfg.get("max_window_layers") is not None else 28
        sliding = bool(cfg.get("use_sliding_window")) and first < cfg.get("num_hidden_layers", 0)
    if sliding and window is not None and int(window) < context:
        raise ValueError(f"sliding-window attention (window {window}, use_sliding_window / layer_types) is not "
                         "supported")


def native_config(cfg: dict) -> "_core.ModelConfig":
    """Checks config.json and converts it; ValueError naming what is missing or unsupported."""
    arch = architecture(cfg)
    c = _core.ModelConfig()
    c.arch = arch

    def need(key):
        if key not in cfg or cfg[key] is None:
            raise ValueError(f"config.json lacks {key!r}")
        return cfg[key]

    q = cfg.get("quantization_config")
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise ValueError(f"quantized checkpoints (quant_method {method!r}) are not supported yet: use the model's "
                         "bf16/fp16 release")
    c.vocab_size = int(need("vocab_size"))
    c.hidden_size = int(need("hidden_size"))
    c.num_layers = int(need("num_hidden_layers"))
    c.num_q_heads = int(need("num_attention_heads"))
    # As transformers' Qwen2/Qwen3 configs: an absent key is their default (32), a null one means one per q head.
    kv = cfg.get("num_key_value_heads", 32)
    c.num_kv_heads = int(c.num_q_heads if kv is None else kv)
    # transformers' Qwen3Config defaults head_dim to 128, Qwen3.5's to 256; Qwen2's is hidden_size / heads.
    default_head_dim = {"qwen3": 128, "qwen3_5": 256}.get(arch, c.hidden_size // c.num_q_heads)
    c.head_dim = int(cfg.get("head_dim") or default_head_dim)
    c.intermediate_size = int(need("intermediate_size"))
    eps = cfg.get("rms_norm_eps")
    c.rms_eps = 1e-6 if eps is None else _number("", "rms_norm_eps", eps)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (the MLP is SwiGLU: silu)")
    if arch in ("qwen3", "qwen3_5") and cfg.get("attention_bias"):
        raise ValueError("attention_bias on a Qwen3 model (biases on q/k/v and o_proj) is not supported")
    c.tie_embeddings = bool(cfg.get("tie_word_embeddings", False))
    c.attn_bias = arch == "qwen2"  # Qwen2: q/k/v biases (o_proj has none)
    c.qk_norm = arch in ("qwen3", "qwen3_5")
    if arch == "qwen3_5":
        _hybrid_fields(cfg, c)
    c.max_position_embeddings = context_limit(cfg, int(need("max_position_embeddings")))
    _check_full_attention(cfg, c.max_position_embeddings)
    inv, af = rope_inv_freq(cfg, rotary_dim(cfg, arch, c.head_dim))
    c.rope_inv_freq = [float(x) for x in inv]
    c.rope_attention_factor = af
    c.weight_prefix = "model."
    return c


def _hybrid_fields(cfg: dict, c: "_core.ModelConfig") -> None:
    """Qwen3.5's layer plan (Gated DeltaNet and gated attention layers) and its DeltaNet sizes, with
    transformers' Qwen3_5TextConfig defaults."""
    c.zero_centred_norms = True
    c.attn_output_gate = True
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json's full_attention_interval must be a positive integer, got {interval!r}")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(c.num_layers)]
    if not isinstance(types, list) or len(types) != c.num_layers or not all(isinstance(t, str) for t in types):
        raise ValueError(f"config.json's layer_types must list a type for each of the {c.num_layers} layers")
    bad = sorted(set(types) - {"full_attention", "linear_attention"})
    if bad:
        raise ValueError(f"layer type {bad[0]!r} is not supported (full_attention, linear_attention)")
    c.layer_types = types
    for field, key, default in (("linear_k_heads", "linear_num_key_heads", 16),
                                ("linear_v_heads", "linear_num_value_heads", 32),
                                ("linear_k_dim", "linear_key_head_dim", 128),
                                ("linear_v_dim", "linear_value_head_dim", 128),
                                ("linear_conv_kernel", "linear_conv_kernel_dim", 4)):
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"config.json's {key} must be a positive integer, got {v!r}")
        setattr(c, field, v)
