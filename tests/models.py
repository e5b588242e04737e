"""Fixture builders: tiny random Qwen2/Qwen3 checkpoints, a tiny BPE tokenizer, and HF references.

Everything here is pure transformers/tokenizers/torch; nothing imports qwen_rt, so the fixtures and
references can be checked on their own:  python tests/models.py  (builds every config into a temp
folder, loads it back with transformers, prints greedy margins).
"""
from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 384  # 256 byte symbols + 3 specials + merges

# Qwen2.5-style ChatML: a default system message when the first message is not a system one, so a
# library that hard-codes ChatML instead of rendering the template gets different prompt tokens.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model reads a short story and writes the next word.
Once upon a time there was a little town by the sea. Every morning the baker opened the shop and the
children ran to school along the harbour. The fishermen came back in the evening with their boats full.
In the middle of the town stood an old clock tower. Nobody remembered who had built it, but everybody
knew that the clock was never wrong. When the bell rang at noon, the market filled with people selling
bread, cheese, apples, fish and flowers. Tell me a joke about a cat and a computer. Hello, how are you
today? I am fine, thank you, and you? The weather is nice and the sun is shining over the hills.
Machine learning models turn text into tokens, tokens into vectors, and vectors back into text again.
Large language models predict the next token given the previous ones; a sampler then picks one token
from the distribution, either the most likely one or a random draw shaped by temperature and top p.
Questions and answers: What is the capital of France? Paris is the capital of France. What is two plus
two? Two plus two is four. Where do penguins live? Most penguins live in the southern hemisphere.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells. Peter Piper
picked a peck of pickled peppers. How much wood would a woodchuck chuck if a woodchuck could chuck wood?
The library keeps a cache of keys and values for every layer, split into pages of sixteen tokens each.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 100 256 1024 2048 4096. Punctuation: , . ; : ! ? ( ) [ ]
"""


def build_tokenizer(folder: Path) -> int:
    """Trains the BPE tokenizer, writes tokenizer.json + tokenizer_config.json; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines * 4, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 512,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for t, i in ids.items()
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_files() -> tuple[str, str, int]:
    """Trains once per process; returns (tokenizer.json text, tokenizer_config.json text, size)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        n = build_tokenizer(Path(d))
        return ((Path(d) / "tokenizer.json").read_text(),
                (Path(d) / "tokenizer_config.json").read_text(), n)


def write_tokenizer(folder: Path) -> int:
    tj, tc, n = _trained_tokenizer_files()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tj)
    (folder / "tokenizer_config.json").write_text(tc)
    return n


def special_ids() -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_trained_tokenizer_files()[0])
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------

# name -> (architecture, config overrides). Common: hidden 64, inter 128, 512 positions.
CONFIGS: dict[str, dict] = {
    # Qwen3, GQA 2, head_dim 24 != 64/4, tied embeddings, 2 layers.
    "qwen3_gqa2_tied": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                            head_dim=24, num_hidden_layers=2, tie_word_embeddings=True),
    # Qwen3, MHA (GQA 1), head_dim 16 == 64/4, untied, 3 layers.
    "qwen3_mha_untied": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=4,
                             head_dim=16, num_hidden_layers=3, tie_word_embeddings=False),
    # Qwen3, GQA 4 (one kv head), head_dim 32, untied.
    "qwen3_gqa4": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=1,
                       head_dim=32, num_hidden_layers=2, tie_word_embeddings=False),
    # Qwen3 with yarn rope scaling (explicit factor; transformers 5 `rope_parameters` form).
    "qwen3_yarn": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=2, tie_word_embeddings=True,
                       rope_extra={"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # Qwen2 with random q/k/v biases, GQA 2, tied.
    "qwen2_bias_gqa2_tied": dict(arch="Qwen2ForCausalLM", num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=2,
                                 tie_word_embeddings=True),
    # Qwen2, 8 q heads (head_dim 8) over 2 kv heads (GQA 4), untied, 3 layers.
    "qwen2_gqa4_untied": dict(arch="Qwen2ForCausalLM", num_attention_heads=8,
                              num_key_value_heads=2, num_hidden_layers=3,
                              tie_word_embeddings=False),
    # Head sizes of real Qwen models (64 / 128), for the GPU kernels.
    "qwen3_hd128_gqa2": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                             head_dim=128, num_hidden_layers=2, tie_word_embeddings=True),
    "qwen3_hd64_gqa4": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=1,
                            head_dim=64, num_hidden_layers=2, tie_word_embeddings=False),
    "qwen2_hd64_bias": dict(arch="Qwen2ForCausalLM", num_attention_heads=2, num_key_value_heads=1,
                            hidden_size=128, num_hidden_layers=2, tie_word_embeddings=True),
    # Qwen3.5 hybrids (Gated DeltaNet + gated attention, partial RoPE 0.25, zero-centred norms).
    # transformers' default plan (every 4th layer attention), value/key heads 2, untied; 4 key heads, so TP=4 runs.
    "qwen35_hybrid": dict(arch="Qwen3_5ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_hidden_layers=4, tie_word_embeddings=False, linear_num_key_heads=4,
                          linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16),
    # Attention first, value/key heads 1, odd head dims, conv width 3, tied.
    "qwen35_mixed_tied": dict(arch="Qwen3_5ForCausalLM", num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                              num_hidden_layers=5, tie_word_embeddings=True, linear_num_key_heads=2,
                              linear_num_value_heads=2, linear_key_head_dim=12, linear_value_head_dim=20,
                              linear_conv_kernel_dim=3,
                              layer_types=["full_attention", "linear_attention", "full_attention",
                                           "linear_attention", "linear_attention"]),
    # value/key heads 3, head_dim 64 (a real size for the GPU kernels).
    "qwen35_ratio3": dict(arch="Qwen3_5ForCausalLM", num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                          num_hidden_layers=3, tie_word_embeddings=False, linear_num_key_heads=2,
                          linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=16,
                          layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # The real head sizes of Qwen3.8-27B (attention 256 with 64 rotated; DeltaNet 128 x 128, value/key heads 2).
    "qwen35_hd256": dict(arch="Qwen3_5ForCausalLM", num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                         num_hidden_layers=4, tie_word_embeddings=False, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128),
}
HYBRID_CONFIGS = [n for n, c in CONFIGS.items() if c["arch"] == "Qwen3_5ForCausalLM"]
# Fixtures of one test module each (not run through every generate test).
EXTRA_CONFIGS: dict[str, dict] = {
    # FP8 under tensor parallelism: each rank's share of o_proj / down_proj / out_proj columns a multiple of 128 at
    # TP=2 (4 x 64 attention columns, intermediate 256, 4 x 64 DeltaNet value columns).
    "qwen3_fp8_tp": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_hidden_layers=2, tie_word_embeddings=False, intermediate_size=256),
    "qwen35_fp8_tp": dict(arch="Qwen3_5ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_hidden_layers=4, tie_word_embeddings=False, intermediate_size=256,
                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                          linear_value_head_dim=64),
}

COMMON = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6)
ROPE_THETA = 1e6


def make_config(name: str, vocab_size: int):
    from transformers import Qwen2Config, Qwen3Config, Qwen3_5TextConfig

    spec = dict(CONFIGS[name] if name in CONFIGS else EXTRA_CONFIGS[name])
    arch = spec.pop("arch")
    rope = {"rope_type": "default", "rope_theta": ROPE_THETA}
    extra = spec.pop("rope_extra", None)
    if extra:
        rope = dict(extra, rope_theta=ROPE_THETA)
    sp = special_ids()
    kw = dict(COMMON, **spec, vocab_size=vocab_size, rope_parameters=rope,
              bos_token_id=None, eos_token_id=sp["<|im_end|>"], pad_token_id=sp["<|endoftext|>"])
    if arch == "Qwen3_5ForCausalLM":
        rope["partial_rotary_factor"] = 0.25
    cls = {"Qwen3ForCausalLM": Qwen3Config, "Qwen2ForCausalLM": Qwen2Config,
           "Qwen3_5ForCausalLM": Qwen3_5TextConfig}[arch]
    if cls is Qwen2Config:
        kw.pop("head_dim", None)
    cfg = cls(**kw)
    cfg.architectures = [arch]
    return cfg


def _init_weights(model, seed: int) -> None:
    """Draws weights large enough that greedy argmaxes are clear (std 0.02 gives near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                # q/k/v biases of Qwen2: non-zero and large enough to matter.
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
            elif "o_proj" in name or "down_proj" in name:
                # Layer outputs large against the embedding in the residual stream, so that tied
                # models do not just echo their last input token.
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def build_model(folder: Path, name: str, seed: int = 1234) -> Path:
    """Builds config `name` into `folder` (weights, config, tokenizer, generation_config)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    vocab = write_tokenizer(folder)
    cfg = make_config(name, vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _init_weights(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(str(folder), safe_serialization=True)
    sp = special_ids()
    gen = GenerationConfig(eos_token_id=[sp["<|im_end|>"], sp["<|endoftext|>"]],
                           pad_token_id=sp["<|endoftext|>"], bos_token_id=None)
    gen.save_pretrained(str(folder))
    return folder


def to_multimodal_layout(folder: Path) -> None:
    """Rewrites a Qwen3_5ForCausalLM folder as Qwen's checkpoints are laid out
    (Qwen3_5ForConditionalGeneration): the text config under text_config, text weights under
    model.language_model., plus vision and MTP tensors that a text-only load skips."""
    def fn(c):
        text = {k: v for k, v in c.items() if k not in ("architectures", "transformers_version", "dtype")}
        text["model_type"] = "qwen3_5_text"
        return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                "text_config": text, "vision_config": {"depth": 1, "hidden_size": 16},
                "tie_word_embeddings": c["tie_word_embeddings"], "dtype": c.get("dtype", "float32")}
    edit_json(Path(folder) / "config.json", fn)
    state = load_state(folder)
    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    out["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2)
    out["mtp.fc.weight"] = torch.randn(4, 8)
    save_state(folder, out)


def add_mtp(folder: Path, mode: str, seed: int = 77) -> None:
    """Gives a Qwen3.5 folder a multi-token-prediction head (mtp.*, config mtp_num_hidden_layers 1), as Qwen's
    checkpoints carry one: fc [H, 2H] over [pre_fc_norm_embedding(embed(token)) | pre_fc_norm_hidden(hidden)], a
    full-attention decoder layer, a norm. mode "random": random weights (its drafts are rarely right). mode "echo":
    the head predicts what the model would if its layers added nothing (fc takes the embedding half, the layer adds
    zero, the norm is the model's final one), and the model's layer outputs are scaled down to 0.001, so that its
    drafts are mostly, not always, right."""
    g = torch.Generator().manual_seed(seed)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    H = cfg["hidden_size"]
    state = load_state(folder)
    attn = next(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    src = f"model.layers.{attn}."
    for k in [k for k in state if k.startswith(src)]:
        v = state[k]
        state["mtp.layers.0." + k[len(src):]] = (1.0 + 0.25 * torch.randn(v.shape, generator=g)
                                                 if k.endswith("norm.weight") or "layernorm" in k
                                                 else 0.15 * torch.randn(v.shape, generator=g))
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        state[f"mtp.{n}.weight"] = 0.25 * torch.randn(H, generator=g)  # zero-centred: gains 1 + w
    state["mtp.fc.weight"] = 0.1 * torch.randn(H, 2 * H, generator=g)
    if mode == "echo":
        for k in list(state):
            if k.startswith("model.") and re.search(r"(o_proj|down_proj|out_proj)\.weight$", k):
                state[k] = 0.001 * state[k]
        state["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
        state["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
        for k in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            state["mtp.layers.0." + k] = torch.zeros_like(state["mtp.layers.0." + k])
        state["mtp.norm.weight"] = state["model.norm.weight"].clone()
    elif mode != "random":
        raise ValueError(mode)
    save_state(folder, state)
    edit_json(Path(folder) / "config.json", lambda c: dict(c, mtp_num_hidden_layers=1))


# ---------------------------------------------------------------------------------------------
# FP8 checkpoints (as Qwen's -FP8 releases and compressed-tensors "FP8 dynamic" lay them out)
# ---------------------------------------------------------------------------------------------

FP8_MAX = 448.0
# The decoder projections an FP8 checkpoint quantizes (in_proj_a / in_proj_b stay as they are, as in Qwen's).
FP8_LINEAR = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
                        r"linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight$")


def fp8_quantize(w: torch.Tensor, rows: int = 128, cols: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization: per rows x cols block s = amax / 448 in fp32 (1 for an all-zero block), q = e4m3(w / s)
    rounded to nearest even; returns (q float8_e4m3fn [R, C], s float32 [ceil(R / rows), ceil(C / cols)])."""
    w = w.float()
    R, C = w.shape
    s = torch.ones((-(-R // rows), -(-C // cols)), dtype=torch.float32)
    q = torch.empty((R, C), dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            b = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            amax = b.abs().max()
            if amax > 0:
                s[i, j] = amax / FP8_MAX
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (b / s[i, j]).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    return q, s


def fp8_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q * s with each scale spread over its block (s of [R / rows, C / cols] blocks, or [R, 1] per row, or [1]),
    an fp32 product."""
    R, C = q.shape
    s = s.float().reshape(s.shape[0] if s.dim() else 1, -1)
    br, bc = -(-R // s.shape[0]), -(-C // s.shape[1])
    full = s.repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    return q.float() * full


def to_fp8(folder: Path, out: Path, ref: Path | None = None, fmt: str = "qwen",
           scale_dtype: torch.dtype = torch.bfloat16, not_converted_prefix: str | None = None) -> Path:
    """Writes folder's model to `out` as an FP8 checkpoint and, to `ref`, the dequantized weights as a float32
    checkpoint for transformers (the reference). fmt "qwen": quant_method fp8, e4m3 weights, weight_scale_inv of
    128 x 128 blocks (scale_dtype), modules_to_not_convert naming lm_head and every in_proj_a/b (named with
    not_converted_prefix instead of the checkpoint's "model." / "model.language_model." when given). fmt "channel":
    compressed-tensors FP8 dynamic, weight_scale [out, 1] per row, ignore ["lm_head", "re:.*in_proj_[ab]$"].
    Every other tensor is kept as stored."""
    out, state = copy_folder(folder, out), load_state(folder)
    deq = dict(state)
    kept = []
    for k, w in list(state.items()):
        if k.endswith((".in_proj_a.weight", ".in_proj_b.weight")):
            kept.append(k[:-len(".weight")])
        if not FP8_LINEAR.search(k):
            continue
        if fmt == "qwen":
            q, s = fp8_quantize(w)
            state[k], state[k[:-len("weight")] + "weight_scale_inv"] = q, s.to(scale_dtype)
        else:
            q, s = fp8_quantize(w, rows=1, cols=w.shape[1])
            state[k], state[k[:-len("weight")] + "weight_scale"] = q, s.to(scale_dtype)
        deq[k] = fp8_dequantize(q, s.to(scale_dtype))
    save_state(out, state)
    if fmt == "qwen":
        if not_converted_prefix is not None:
            kept = [not_converted_prefix + m.split(".layers.", 1)[1] for m in kept]
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head"] + kept}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "re:.*in_proj_[ab]$"],
              "config_groups": {"group_0": {"targets": ["Linear"],
                                            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                        "symmetric": True, "dynamic": False},
                                            "input_activations": {"num_bits": 8, "type": "float",
                                                                  "strategy": "token", "dynamic": True}}}}

    def add_qc(c):
        c["quantization_config"] = qc
    edit_json(out / "config.json", add_qc)
    if ref is not None:
        ref = copy_folder(folder, ref)
        save_state(ref, {k: v.float() if k in state and FP8_LINEAR.search(k) else v for k, v in deq.items()})
    return out


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def edit_json(path: Path, fn) -> None:
    data = json.loads(Path(path).read_text())
    out = fn(data)
    Path(path).write_text(json.dumps(data if out is None else out, indent=2))


def to_legacy_rope(folder: Path) -> None:
    """Rewrites config.json to the pre-transformers-5 form: top-level rope_theta + rope_scaling."""
    def fn(c):
        rp = c.pop("rope_parameters")
        c["rope_theta"] = rp.pop("rope_theta")
        if rp.get("rope_type", "default") != "default":
            c["rope_scaling"] = rp
        else:
            c["rope_scaling"] = None
    edit_json(Path(folder) / "config.json", fn)


def safetensors_path(folder: Path) -> Path:
    return Path(folder) / "model.safetensors"


def load_state(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(safetensors_path(folder)))


def save_state(folder: Path, state: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(safetensors_path(folder)),
              metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# References (transformers, fp32, eager attention, full forward each step: no cache, no stopping)
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def hf_model(folder: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype),
                                             attn_implementation="eager")
    m.eval()
    return m


@functools.lru_cache(maxsize=None)
def hf_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def hf_logits(folder, ids, all_positions: bool = False, dtype: str = "float32") -> np.ndarray:
    """Logits of transformers (fp32 unless `dtype` says otherwise) for `ids`: last position [V], or every
    position [T, V]."""
    m = hf_model(str(folder), dtype)
    with torch.no_grad():
        out = m(torch.tensor([list(ids)], dtype=torch.long)).logits[0].double().numpy()
    return out if all_positions else out[-1]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@functools.lru_cache(maxsize=4096)
def _greedy_cached(folder: str, prompt: tuple, n: int):
    ids = list(prompt)
    toks, margins, lps = [], [], []
    for _ in range(n):
        lg = hf_logits(folder, ids)
        order = np.argsort(-lg, kind="stable")
        t = int(order[0])
        toks.append(t)
        margins.append(float(lg[order[0]] - lg[order[1]]))
        lps.append(log_softmax(lg))
        ids.append(t)
    return tuple(toks), tuple(margins), tuple(lps)


def hf_greedy(folder, prompt_ids, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens (argmax over a full fp32 forward each step; never stops)."""
    return list(_greedy_cached(str(folder), tuple(int(i) for i in prompt_ids), max_new_tokens)[0])


def hf_greedy_margins(folder, prompt_ids, max_new_tokens: int) -> list[float]:
    """Top-1 minus top-2 logit at each greedy step (how safe an exact-match comparison is)."""
    return list(_greedy_cached(str(folder), tuple(int(i) for i in prompt_ids), max_new_tokens)[1])


def hf_greedy_logprobs(folder, prompt_ids, max_new_tokens: int) -> list[np.ndarray]:
    """log_softmax of transformers' logits at each greedy step, float64 [V] each."""
    return list(_greedy_cached(str(folder), tuple(int(i) for i in prompt_ids), max_new_tokens)[2])


def penalized_greedy(folder, prompt_ids, n, repetition_penalty=1.0, presence_penalty=0.0,
                     frequency_penalty=0.0, banned_until=0, banned=()) -> list[int]:
    """Greedy with the penalty semantics of cpp/backend/ops.h (steps 2-5): repetition over
    prompt + output, presence/frequency over output; `banned` forced to -inf for the first
    `banned_until` generated tokens (min_tokens)."""
    ids = list(prompt_ids)
    out: list[int] = []
    for step in range(n):
        x = hf_logits(folder, ids).copy()
        if step < banned_until:
            for t in banned:
                x[t] = -np.inf
        if repetition_penalty != 1.0:
            for t in set(ids):
                x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
        if presence_penalty or frequency_penalty:
            for t in set(out):
                x[t] -= out.count(t) * frequency_penalty + presence_penalty
        t = int(np.argmax(x))
        out.append(t)
        ids.append(t)
    return out


def random_prompt(rng: np.random.Generator, n: int, vocab: int, avoid=()) -> list[int]:
    """n random token ids in [0, vocab) that avoid the special ids."""
    avoid = set(avoid)
    allowed = np.array([i for i in range(vocab) if i not in avoid])
    return [int(x) for x in rng.choice(allowed, size=n)]


if __name__ == "__main__":  # self-check of the fixtures, without qwen_rt
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d:
        sp = special_ids()
        for name in CONFIGS:
            f = build_model(Path(d) / name, name)
            cfg = json.loads((f / "config.json").read_text())
            tok = hf_tokenizer(str(f))
            assert len(tok) == cfg["vocab_size"], (len(tok), cfg["vocab_size"])
            rng = np.random.default_rng(0)
            worst = []
            for plen in (1, 7, 50):
                p = random_prompt(rng, plen, cfg["vocab_size"], sp.values())
                m = hf_greedy_margins(f, p, 20)
                worst.append(min(m))
                g = hf_greedy(f, p, 20)
            print(name, cfg.get("rope_parameters"), "min margins", [round(w, 4) for w in worst],
                  "tokens", g[:10])


# ---------------------------------------------------------------------------------------------
# Test helpers (shared by the test modules)
# ---------------------------------------------------------------------------------------------

# Minimum top-1/top-2 logit gap at every reference greedy step of an exact-match comparison.
# fp32 forward passes of these models differ from float64 by ~1e-5 in the logits, so a gap of
# 1e-3 is ~100x the numerical noise: a mismatch there is a bug, not a tie.
MARGIN = 1e-3


def model_info(folder) -> dict:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"],
        layers=cfg["num_hidden_layers"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        specials=sorted(special_ids().values()),
        config=cfg,
    )


def attention_layers(folder) -> int:
    """Layers with K/V: all, or a hybrid's full-attention layers (layer_types, else every 4th)."""
    cfg = model_info(folder)["config"]
    n = cfg["num_hidden_layers"]
    if cfg.get("model_type", "").startswith("qwen3_5"):
        types = cfg.get("layer_types") or ["full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0
                                           else "linear_attention" for i in range(n)]
        return sum(t == "full_attention" for t in types)
    return n


def kv_bytes(folder, pages: int, page_size: int = 16, dtype_bytes: int = 4, fp8: bool = False) -> int:
    """Bytes of a KV pool of `pages` pages: K and V for every attention layer, fp32 (or dtype_bytes an element; fp8:
    1 byte an element and a 4-byte scale per token and kv head)."""
    i = model_info(folder)
    row = i["kv_heads"] * (i["head_dim"] + 4) if fp8 else i["kv_heads"] * i["head_dim"] * dtype_bytes
    return pages * page_size * attention_layers(folder) * 2 * row


def pick_prompts(folder, seed: int, lengths, max_new: int, margin: float = MARGIN,
                 no_specials_out: bool = False, prefix_len: int = 0) -> list[list[int]]:
    """One random prompt per length (no special ids in it), redrawn until transformers' greedy
    continuation of max_new tokens has a top-2 gap >= margin at every step (deterministic).
    prefix_len: every prompt starts with one random prefix of that many tokens, then has `length` of its own."""
    info = model_info(folder)
    rng = np.random.default_rng(seed)
    prefix = random_prompt(rng, prefix_len, info["vocab_size"], info["specials"]) if prefix_len else []
    out = []
    for n in lengths:
        for _attempt in range(50):
            p = prefix + random_prompt(rng, n, info["vocab_size"], info["specials"])
            if min(hf_greedy_margins(folder, p, max_new)) < margin:
                continue
            if no_specials_out and set(hf_greedy(folder, p, max_new)) & set(info["specials"]):
                continue
            out.append(p)
            break
        else:
            raise AssertionError(f"fixture: no well-conditioned prompt of length {n}")
    return out


def greedy_mismatch(folder, prompt, got, n=None) -> str:
    """'' when got == transformers' greedy continuation, else a message naming the first
    diverging step and the reference margin there."""
    n = len(got) if n is None else n
    ref = hf_greedy(folder, prompt, n)
    if list(got) == ref:
        return ""
    margins = hf_greedy_margins(folder, prompt, n)
    i = next((k for k in range(min(len(got), n)) if got[k] != ref[k]), min(len(got), n))
    m = margins[i] if i < n else float("nan")
    return (f"prompt len {len(prompt)}: tokens diverge at step {i} (reference margin {m:.3g}):\n"
            f"  got {list(got)}\n  ref {ref}")


# Generator arguments every test starts from: CPU, exact fp32, a KV pool that holds
# max_batch_size full-length sequences (so nothing is preempted unless a test wants it).
BASE_KW = dict(device="cpu", dtype="float32", max_batch_size=16, page_size=16)
BASE_MAX_LEN = 512


def base_kwargs(folder, **overrides) -> dict:
    kw = dict(BASE_KW)
    kw.update(overrides)
    if "kv_cache_memory" not in kw:
        max_len = kw.get("max_model_len") or BASE_MAX_LEN
        pages = kw["max_batch_size"] * -(-max_len // kw["page_size"])
        kw["kv_cache_memory"] = kv_bytes(folder, pages, kw["page_size"])
    return kw
