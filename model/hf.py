"""kiln's model and Hugging Face `transformers`' GPT-2 and Llama, tensor by tensor and field by field.

The mapping lives beside the model because it depends on the model's names and shapes; `pipeline/convert.py`
reads and writes the folders. What it decides:
- Exact or refused: an HF config field that would make HF's model compute something kiln's does not (rope
  scaling, biases or another activation on Llama, a head_dim other than hidden/heads, an untied or
  differently scaled GPT-2, dropout rates that differ) is a ValueError naming the field, never approximated.
- Weights are moved, never recomputed: renames, transposes (GPT-2's Conv1D stores (in, out)), GPT-2's fused
  c_attn split into q/k/v and concatenated back, and the vocabulary rows kiln pads to a multiple of 64
  (`padded_vocab_size`) added as zeros on import and dropped on export. kiln's `apply_rope` pairs the two
  halves of each head, HF Llama's rotate_half layout, so q/k need no permutation. `rules` is the whole
  mapping, read in both directions.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT

ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "llama"}
# Qwen3 is Llama with an RMSNorm over each head's queries and keys before RoPE: kiln's llama with model.qk_norm.
QK_NORM_ARCHITECTURE = "Qwen3ForCausalLM"


# --- weights -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """One HF tensor and the kiln tensor(s) it holds."""

    hf: str
    kiln: tuple[str, ...]     # several: concatenated along dim 0 (GPT-2's c_attn holds q, k, v)
    conv1d: bool = False      # HF stores it transposed, (in, out): GPT-2's Conv1D
    vocab_rows: bool = False  # one row per token: kiln pads them to padded_vocab_size


EMBEDDING = {"llama": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight"}
# Per layer: kiln name under blocks.{i} -> HF name under model.layers.{i} (Llama) or transformer.h.{i} (GPT-2).
LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
GPT2_LAYER = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"): "attn.c_attn.weight",
    ("attn.q_proj.bias", "attn.k_proj.bias", "attn.v_proj.bias"): "attn.c_attn.bias",
    "attn.o_proj.weight": "attn.c_proj.weight",
    "attn.o_proj.bias": "attn.c_proj.bias",
    "mlp_norm.weight": "ln_2.weight",
    "mlp_norm.bias": "ln_2.bias",
    "mlp.up_proj.weight": "mlp.c_fc.weight",
    "mlp.up_proj.bias": "mlp.c_fc.bias",
    "mlp.down_proj.weight": "mlp.c_proj.weight",
    "mlp.down_proj.bias": "mlp.c_proj.bias",
}


def check_convertible(config: ModelConfig) -> None:
    """HF's Llama (and Qwen3) has RMSNorm and its GPT-2 LayerNorm, nothing else: another `norm` has no HF
    equivalent; of the record runs' knobs, only QK-norm on llama (Qwen3's) has one. (zero_init is an
    initialisation: a trained model has no trace of it.)"""
    own = ModelConfig(vocab_size=1, arch=config.arch).norm_kind
    if config.norm_kind != own:
        raise ValueError(f"model.norm={config.norm}: HF's {config.arch} model has only {own}, so a {config.arch} "
                         f"model with {config.norm_kind} has no HF equivalent")
    if config.mlp != "auto":
        raise ValueError(f"model.mlp={config.mlp}: HF's Llama, Qwen3 and GPT-2 models have no ungated ReLU² MLP, so "
                         f"this model has no HF equivalent")
    if config.logit_softcap:
        raise ValueError(f"model.logit_softcap={config.logit_softcap}: HF's Llama, Qwen3 and GPT-2 models do not cap "
                         f"their logits, so this model has no HF equivalent")
    if config.qk_norm and config.arch == "gpt2":
        raise ValueError("model.qk_norm=true: HF's GPT-2 model has no QK-norm (a llama model with it exports as "
                         "Qwen3), so this model has no HF equivalent")


def rules(config: ModelConfig) -> list[Rule]:
    """Every tensor of the HF checkpoint for `config`, with the kiln tensors it is made of."""
    check_convertible(config)
    if config.arch == "llama":
        out = [Rule(EMBEDDING["llama"], ("tok_emb.weight",), vocab_rows=True),
               Rule("model.norm.weight", ("norm.weight",))]
        if not config.tie_embeddings:
            out.append(Rule("lm_head.weight", ("lm_head.weight",), vocab_rows=True))
        for i in range(config.n_layer):
            out += [Rule(f"model.layers.{i}.{hf}", (f"blocks.{i}.{kiln}",)) for kiln, hf in LLAMA_LAYER.items()]
            if config.qk_norm:
                out += [Rule(f"model.layers.{i}.self_attn.{n}.weight", (f"blocks.{i}.attn.{n}.weight",))
                        for n in ("q_norm", "k_norm")]
        return out
    out = [Rule(EMBEDDING["gpt2"], ("tok_emb.weight",), vocab_rows=True),
           Rule("transformer.wpe.weight", ("pos_emb.weight",)),
           Rule("transformer.ln_f.weight", ("norm.weight",)),
           Rule("transformer.ln_f.bias", ("norm.bias",))]
    for i in range(config.n_layer):
        for kiln, hf in GPT2_LAYER.items():
            names = (kiln,) if isinstance(kiln, str) else kiln
            out.append(Rule(f"transformer.h.{i}.{hf}", tuple(f"blocks.{i}.{n}" for n in names),
                            conv1d=hf.endswith("weight") and ".c_" in hf))
    return out


def to_hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors from a kiln state dict (a tied lm_head, if present, is ignored)."""
    out = {}
    for rule in rules(config):
        t = torch.cat([state[name] for name in rule.kiln]) if len(rule.kiln) > 1 else state[rule.kiln[0]]
        if rule.vocab_rows:
            t = t[:config.vocab_size]
        out[rule.hf] = (t.T if rule.conv1d else t).contiguous()
    return out


def to_kiln_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """kiln tensors (tied lm_head left out, as save_model stores them) from HF tensors checked by hf_shapes."""
    out = {}
    for rule in rules(config):
        t = tensors[rule.hf].T if rule.conv1d else tensors[rule.hf]
        if rule.vocab_rows:
            t = F.pad(t, (0, 0, 0, config.padded_vocab_size - config.vocab_size))
        for name, part in zip(rule.kiln, t.chunk(len(rule.kiln)), strict=True):
            out[name] = part.contiguous()
    return out


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor an HF checkpoint for `config` holds, mapped from a model on the meta
    device (no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    return {name: tuple(t.shape) for name, t in to_hf_tensors(model.state_dict(), config).items()}


# --- configs -------------------------------------------------------------------------------------------------

# Fields that could make HF's model compute something kiln's does not: field -> the values kiln's model
# matches. An absent field takes transformers' default, which is always one of them.
LLAMA_FIXED = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
               "attention_dropout": (0, 0.0), "partial_rotary_factor": (1, 1.0)}
QWEN3_FIXED = {**LLAMA_FIXED, "use_sliding_window": (False,)}
# gelu_new and gelu_pytorch_tanh are both GELU's tanh approximation, the one kiln uses; reorder_and_upcast_attn
# changes only how fp16 rounds, so it is not here.
GPT2_FIXED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
              "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,),
              "tie_word_embeddings": (True,)}
GPT2_DROPOUTS = ("embd_pdrop", "attn_pdrop", "resid_pdrop")


def kiln_config(hf: dict, where: str) -> ModelConfig:
    """The ModelConfig that computes exactly what HF's model for config `hf` computes, or ValueError naming the
    field. Every field read is checked by type and range: config.json is untrusted input."""
    archs = hf.get("architectures")
    name = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    arch = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ValueError(f"{where}: architectures={reprlib.repr(archs)} is not supported (kiln converts "
                        f"{', '.join(list(ARCHITECTURES)[:-1])} or {list(ARCHITECTURES)[-1]})")
    qk_norm = name == QK_NORM_ARCHITECTURE
    for name, allowed in (QWEN3_FIXED if qk_norm else LLAMA_FIXED if arch == "llama" else GPT2_FIXED).items():
        # By type too: `1` is not `true`, and NaN equals nothing.
        if name in hf and not any(hf[name] == a and type(hf[name]) is type(a) for a in allowed):
            raise ValueError(f"{where}: {name}={reprlib.repr(hf[name])} is not supported (kiln's {arch} model computes "
                            f"{' / '.join(map(repr, allowed))})")
    values = _llama_values(hf, where) if arch == "llama" else _gpt2_values(hf, where)
    try:
        return ModelConfig(arch=arch, **values, **({"qk_norm": True} if qk_norm else {})).check()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a shape kiln's model takes (model.{e})") from None


def _size(hf: dict, name: str, where: str, default: int | None = None) -> int:
    """A positive integer field. `default` stands for an absent or null one; without it the field is required
    (a size has no default worth assuming)."""
    value = hf.get(name)
    if value is None and default is not None:
        return default
    if name not in hf:
        raise ValueError(f"{where}: {name}: missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {name}: expected a positive integer, got {reprlib.repr(value)}")
    return value


def _real(value, name: str, where: str, default: float, rate: bool = False) -> float:
    """Field `name`'s `value`: a finite positive number, or a dropout `rate` in [0, 1); `default` stands for an
    absent (null) one."""
    if value is None:
        return default
    try:
        x = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        x = math.inf
    if not (0 <= x < 1 if rate else 0 < x < math.inf):
        raise ValueError(f"{where}: {name}: expected {'a number in [0, 1)' if rate else 'a finite positive number'}"
                         f", got {reprlib.repr(value)}")
    return x


def _flag(hf: dict, name: str, where: str, default: bool) -> bool:
    value = hf.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name}: expected true or false, got {reprlib.repr(value)}")
    return value


def _llama_values(hf: dict, where: str) -> dict:
    d, heads = _size(hf, "hidden_size", where), _size(hf, "num_attention_heads", where)
    head_dim = hf.get("head_dim")
    if head_dim is not None and _size(hf, "head_dim", where) * heads != d:
        raise ValueError(f"{where}: head_dim={head_dim} is not supported (kiln's head_dim is "
                        f"hidden_size/num_attention_heads = {d}/{heads})")
    ffn = _size(hf, "intermediate_size", where)
    derived = ModelConfig(vocab_size=1, arch="llama", d_model=d).ffn_dim
    return {"vocab_size": _size(hf, "vocab_size", where), "n_layer": _size(hf, "num_hidden_layers", where),
            "n_head": heads, "n_kv_head": _size(hf, "num_key_value_heads", where, default=heads), "d_model": d,
            "d_ff": 0 if ffn == derived else ffn,  # 0: kiln's own rule gives it (round trips as 0)
            "max_seq_len": _size(hf, "max_position_embeddings", where), "rope_theta": _rope_theta(hf, where),
            "norm_eps": _real(hf.get("rms_norm_eps"), "rms_norm_eps", where, 1e-6),
            "tie_embeddings": _flag(hf, "tie_word_embeddings", where, False), "dropout": 0.0}


def _rope_theta(hf: dict, where: str) -> float:
    """transformers 5 writes rope_parameters {rope_type, rope_theta}; earlier versions rope_theta and
    rope_scaling. Only the unscaled ("default") rotation is kiln's."""
    key = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    rope = hf.get(key)
    rope = {} if rope is None else rope
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: {key}: expected an object, got {reprlib.repr(rope)}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{where}: {key}.rope_type={reprlib.repr(kind)} is not supported (kiln's rotary embedding is "
                        f"unscaled: 'default')")
    other = sorted(set(rope) - {"rope_type", "type", "rope_theta"})
    if other:
        name = other[0] if other[0].isidentifier() else reprlib.repr(other[0])  # a key may hold a newline
        raise ValueError(f"{where}: {key}.{name}={reprlib.repr(rope[other[0]])} is not supported (kiln's rotary "
                        f"embedding takes only rope_theta)")
    if "rope_theta" in rope:
        return _real(rope["rope_theta"], f"{key}.rope_theta", where, 10000.0)
    return _real(hf.get("rope_theta"), "rope_theta", where, 10000.0)


def _gpt2_values(hf: dict, where: str) -> dict:
    # 0.1: transformers' default for each rate
    rates = {name: _real(hf.get(name), name, where, 0.1, rate=True) for name in GPT2_DROPOUTS}
    if len(set(rates.values())) > 1:
        raise ValueError(f"{where}: {', '.join(f'{k}={v}' for k, v in rates.items())} is not supported (kiln's "
                        f"model has one dropout rate)")
    d, heads = _size(hf, "n_embd", where), _size(hf, "n_head", where)
    inner = _size(hf, "n_inner", where, default=4 * d)
    return {"vocab_size": _size(hf, "vocab_size", where), "n_layer": _size(hf, "n_layer", where),
            "n_head": heads, "n_kv_head": heads, "d_model": d,
            "d_ff": 0 if inner == 4 * d else inner,  # 0: kiln's own rule gives it (round trips as 0)
            "max_seq_len": _size(hf, "n_positions", where),
            "norm_eps": _real(hf.get("layer_norm_epsilon"), "layer_norm_epsilon", where, 1e-5), "tie_embeddings": True,
            "dropout": rates["resid_pdrop"]}


def hf_config(config: ModelConfig, special: dict[str, int | None]) -> dict:
    """The HF config.json for a kiln config. Written in the pre-5 spelling (torch_dtype, rope_theta), which
    transformers 4 needs and 5 still reads. `special`: bos/eos/pad token ids."""
    check_convertible(config)
    common = {"vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_embeddings,
              **special, "torch_dtype": "float32", "use_cache": True}
    if config.arch == "llama" and config.qk_norm:
        # Qwen3's own fields: no sliding window on any layer
        qwen3 = {"architectures": [QK_NORM_ARCHITECTURE], "model_type": "qwen3", "use_sliding_window": False,
                 "sliding_window": None, "max_window_layers": config.n_layer}
        return {**hf_config(dataclasses.replace(config, qk_norm=False), special), **qwen3}
    if config.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.d_model,
                "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layer,
                "num_attention_heads": config.n_head, "num_key_value_heads": config.n_kv_head,
                "head_dim": config.head_dim, "hidden_act": "silu",
                "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
                "rope_theta": config.rope_theta, "rope_scaling": None, "attention_bias": False,
                "attention_dropout": 0.0, "mlp_bias": False, **common}
    if config.n_kv_head != config.n_head:
        raise ValueError(f"model.n_kv_head={config.n_kv_head}: HF GPT-2 has no grouped-query attention "
                        f"(it needs n_kv_head = n_head = {config.n_head})")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": config.d_model,
            "n_inner": config.d_ff or None, "n_layer": config.n_layer, "n_head": config.n_head,
            "n_positions": config.max_seq_len, "activation_function": "gelu_pytorch_tanh",
            "layer_norm_epsilon": config.norm_eps, **{name: config.dropout for name in GPT2_DROPOUTS},
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False, **common}


# --- LoRA adapters in PEFT's format --------------------------------------------------------------------------

PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model, so its names gain this


def token_rows_base(state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], spec: dict,
                    config: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` (a merged model's) with its trained token rows back at the start's values: the base that PEFT's
    trainable tokens write their rows over (a tied head shares the embedding's rows)."""
    if "trainable_tokens" not in spec:
        return state
    ids = torch.tensor(spec["trainable_tokens"])
    table = state["tok_emb.weight"].index_copy(0, ids, adapter["tok_emb.trainable_tokens_original"].to(
        state["tok_emb.weight"].dtype))
    return {**state, "tok_emb.weight": table, **({"lm_head.weight": table} if config.tie_embeddings else {})}


def lora_deltas(adapter: dict[str, torch.Tensor], spec: dict) -> dict[str, torch.Tensor]:
    """kiln weight name -> the (out, in) update its adapter adds: (alpha / rank) B A, in float32."""
    scaling = spec["alpha"] / spec["rank"]
    return {name.removesuffix(".lora_A.weight") + ".weight":
            scaling * adapter[name.replace(".lora_A.", ".lora_B.")].float() @ a.float()
            for name, a in adapter.items() if name.endswith(".lora_A.weight")}


def peft_adapter(adapter: dict[str, torch.Tensor], spec: dict, config: ModelConfig,
                 base: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(adapter_model.safetensors tensors, adapter_config.json) for PEFT's LoRA on the HF model of `config`.

    Names follow `rules`. GPT-2 keeps q, k and v in one Conv1D (c_attn), so their adapters become one of rank
    3·rank there: A stacked, B block-diagonal, which adds exactly the three updates (an unadapted part
    contributes zeros); `rank_pattern` / `alpha_pattern` keep its scaling alpha / rank."""
    rank, alpha = spec["rank"], spec["alpha"]
    tensors, targets, ranks = {}, set(), {}
    for rule in rules(config):
        parts = [name.removesuffix(".weight") for name in rule.kiln]
        if not rule.hf.endswith(".weight") or not any(f"{p}.lora_A.weight" in adapter for p in parts):
            continue
        module = rule.hf.removesuffix(".weight")
        a_parts, b_parts = [], []
        for p in parts:
            a, b = adapter.get(f"{p}.lora_A.weight"), adapter.get(f"{p}.lora_B.weight")
            if a is None:  # fused with adapted projections but not adapted: GPT-2's q, k, v are all d x d
                a, b = torch.zeros(rank, config.d_model), torch.zeros(config.d_model, rank)
            a_parts.append(a)
            b_parts.append(b)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.cat(a_parts).contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.block_diag(*b_parts).contiguous()
        suffix = ".".join(module.split(".")[-2:])  # self_attn.q_proj, attn.c_attn: PEFT matches name endings
        targets.add(suffix)
        if len(parts) > 1:
            ranks[suffix] = len(parts)
    if "trainable_tokens" in spec:  # PEFT's name; it holds the rows' values (model/lora.py, TrainableTokens)
        embedding = EMBEDDING[config.arch].removesuffix(".weight")
        tensors[f"{PEFT_PREFIX}{embedding}.token_adapter.trainable_tokens_delta"] = (
            adapter["tok_emb.trainable_tokens_delta"].contiguous())
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": alpha, "lora_dropout": spec["dropout"], "target_modules": sorted(targets), "bias": "none",
        "fan_in_fan_out": config.arch == "gpt2", "init_lora_weights": True, "use_rslora": False,
        "rank_pattern": {k: rank * n for k, n in ranks.items()},
        "alpha_pattern": {k: alpha * n for k, n in ranks.items()},
        "modules_to_save": None, "inference_mode": True,
        **({"trainable_token_indices": list(spec["trainable_tokens"])} if "trainable_tokens" in spec else {})}
    return tensors, peft_config
