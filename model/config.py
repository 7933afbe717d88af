"""The model's shape, `ModelConfig`: what every stage reads and checks, so it imports no torch.

It owns the shape rules (divisibility, head sizes, the derived MLP width, the padded vocabulary), the parameter
count and the memory a model needs, checked against a device's free memory before anything is allocated.
torch is imported only to ask a CUDA device for its free memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace

ARCHS = ("llama", "gpt2")
NORMS = ("auto", "rmsnorm", "layernorm", "dyt")
MLPS = ("auto", "relu2")
# The record runs' model changes (modded-nanogpt, nanochat), each off at this value: a config saves a knob only
# when it is on (to_dict), so every model and checkpoint written before they existed keeps its config and identity.
KNOBS_OFF = {"qk_norm": False, "mlp": "auto", "logit_softcap": 0.0, "zero_init": False}
# fp32 weights; training adds their gradients and AdamW's two moments (activations come on top, by batch).
BYTES_PER_PARAM = {"for its weights": 4, "to train": 16}
SIZE_FIELDS = ("n_layer", "d_model", "d_ff", "vocab_size", "max_seq_len")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class ModelConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4          # < n_head: grouped-query attention (llama); == n_head: plain multi-head
    d_model: int = 256
    d_ff: int = 0               # MLP hidden size; 0 = derive from d_model (see ffn_dim)
    max_seq_len: int = 256
    arch: str = "llama"         # llama | gpt2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # gpt2 always ties
    dropout: float = 0.0
    norm: str = "auto"          # auto (llama: rmsnorm, gpt2: layernorm) | rmsnorm | layernorm | dyt
    qk_norm: bool = False       # RMSNorm (with a gain) over each head's queries and keys, before RoPE (Qwen3's)
    mlp: str = "auto"           # auto (llama: SwiGLU, gpt2: GELU) | relu2: down(relu(up(x))^2), no gate
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap) (Gemma 2's final softcapping); 0: off
    zero_init: bool = False     # the two residual output projections start at zero (modded-nanogpt)

    @property
    def norm_kind(self) -> str:
        """The normalisation actually built: `norm` with auto resolved by the architecture."""
        if self.norm != "auto":
            return self.norm
        return "rmsnorm" if self.arch == "llama" else "layernorm"

    @property
    def padded_vocab_size(self) -> int:
        """The embedding/head rows actually allocated: a multiple of 64 keeps the largest matmul on fast tile
        shapes (nanoGPT's 50257 -> 50304). The extra rows are never looked up and never predicted."""
        return _round_up(self.vocab_size, 64)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def gated(self) -> bool:
        """Whether the MLP has a gate (llama's SwiGLU): three matrices rather than two."""
        return self.arch == "llama" and self.mlp == "auto"

    @property
    def ffn_dim(self) -> int:
        """Resolved MLP hidden size. SwiGLU has three matrices instead of two, so llama uses 8/3·d_model to
        spend the same parameters as GPT-2's 4·d_model, rounded up to a multiple of 64 for the matmuls; an ungated
        MLP (gpt2's, relu2) has 4·d_model."""
        if self.d_ff > 0:
            return self.d_ff
        if self.gated:
            return _round_up((8 * self.d_model + 2) // 3, 64)  # ceil(8/3·d), then up to a multiple of 64
        return 4 * self.d_model

    def check(self) -> ModelConfig:
        """Raise ValueError naming the first bad field ("n_head: 6 does not divide d_model=256"); return self."""
        for f in fields(self):
            value = getattr(self, f.name)
            want = {"int": int, "float": (int, float), "str": str, "bool": bool}[f.type]
            # bool is an int in Python; a `true` where a size belongs is a typo, not a 1.
            if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
                raise ValueError(f"{f.name}: expected {f.type}, got {value!r}")
        for name in ("rope_theta", "norm_eps", "dropout", "logit_softcap"):  # config.json may hold NaN or Infinity
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be a finite number, got {getattr(self, name)}")
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "max_seq_len", "rope_theta",
                     "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.d_ff < 0:
            raise ValueError(f"d_ff: must be >= 0 (0 = derive from d_model), got {self.d_ff}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch: {self.arch!r} is not one of {', '.join(ARCHS)}")
        if self.norm not in NORMS:
            raise ValueError(f"norm: {self.norm!r} is not one of {', '.join(NORMS)}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp: {self.mlp!r} is not one of {', '.join(MLPS)}")
        if self.logit_softcap < 0:
            raise ValueError(f"logit_softcap: must be >= 0 (0 = off), got {self.logit_softcap}")
        if self.d_model % self.n_head:
            raise ValueError(f"n_head: {self.n_head} does not divide d_model={self.d_model}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head: {self.n_kv_head} does not divide n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"n_head: head_dim={self.head_dim} (d_model/n_head) must be even for rotary "
                             f"embeddings")
        if self.arch == "gpt2" and not self.tie_embeddings:
            raise ValueError("tie_embeddings: gpt2 always ties the LM head to the token embedding")
        return self

    def num_params(self, embeddings: bool = True) -> int:
        """What `GPT(self).num_params(embeddings)` counts, from the shape alone: nothing is built, so it is
        instant for any size (the scaling sweep sizes models by it, the memory check below refuses by it)."""
        d, inner, kv, f = self.d_model, self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.ffn_dim
        gpt2 = self.arch == "gpt2"
        norm = {"rmsnorm": d, "layernorm": 2 * d, "dyt": 2 * d + 1}[self.norm_kind]  # gain, bias, DyT's alpha
        attn = 2 * d * inner + 2 * d * kv + (inner + 2 * kv + d if gpt2 else 0)
        mlp = 2 * d * f + (f + d if gpt2 else 0) + (d * f if self.gated else 0)  # up, down (biases), gate
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        n = self.n_layer * (attn + mlp + 2 * norm + qk_norm) + norm + (self.norm_kind == "dyt")  # DyT's embedding scale
        if not self.tie_embeddings:
            n += self.padded_vocab_size * d  # the LM head
        if embeddings:
            n += self.padded_vocab_size * d + (self.max_seq_len * d if gpt2 else 0)
        return n

    def memory_bytes(self, need: str) -> int:
        """Bytes the model needs `for its weights` or `to train` (see BYTES_PER_PARAM), with the rotary tables."""
        rope = self.max_seq_len * self.head_dim * 4 if self.arch == "llama" else 0
        return self.num_params() * BYTES_PER_PARAM[need] + rope

    def check_fits(self, device, need: str = "for its weights",
                   names: tuple[str, ...] = SIZE_FIELDS) -> ModelConfig:
        """Raise ValueError if the model cannot fit in `device`'s free memory, before anything is allocated: a
        typo such as n_layer=1e9 would otherwise hang building a billion layers, or ask for petabytes. The
        error names the field among `names` whose default would shrink the estimate most; return self."""
        want, have = self.memory_bytes(need), memory_available(device)
        if want <= have:
            return self
        defaults = ModelConfig(vocab_size=256)
        name = min(names, key=lambda k: replace(self, **{k: getattr(defaults, k)}).memory_bytes(need))
        where = "this machine" if _device_type(device) in ("cpu", "meta") else str(device)
        raise ValueError(f"{name}={getattr(self, name)}: the model needs ~{_human(want)} {need} "
                         f"({BYTES_PER_PARAM[need]} bytes per parameter), {where} has {_human(have)} free")

    def to_dict(self) -> dict:
        """The fields, less the knobs that are off (KNOBS_OFF)."""
        return {k: v for k, v in asdict(self).items() if not (k in KNOBS_OFF and v == KNOBS_OFF[k])}

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build and check a config from JSON-like data; unknown keys are an error, not silently dropped,
        so a typo in a saved config cannot quietly fall back to a default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {', '.join(map(repr, unknown))}")
        if "vocab_size" not in d:
            raise ValueError("vocab_size: missing")
        return cls(**d).check().check_fits("cpu")  # a saved model is loaded on the host first


def _device_type(device) -> str:
    """"cuda" for torch.device("cuda", 1) or "cuda:1": a device's kind without importing torch."""
    return str(device).split(":")[0]


def memory_available(device) -> int:
    """Free bytes on `device` (a torch.device or its name): CUDA's own count, else the host's available RAM (a
    meta tensor is a model that will be materialised on the host). MemAvailable counts the page cache the
    kernel would give back; where /proc/meminfo is missing (macOS), the physical RAM is the bound."""
    if _device_type(device) == "cuda":
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _human(n: int) -> str:
    n = float(min(n, 10**300))  # a shape of 10**400 layers is still an error message, not an OverflowError
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} EB"


