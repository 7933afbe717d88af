"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen base, optionally stored in 4-bit NF4 (QLoRA, Dettmers
et al. 2023).

LoRA leaves a projection W (out, in) frozen and trains A (rank, in) and B (out, rank): y = W x + (alpha/rank)
B A dropout(x). B starts at zero, so before the first step the model computes exactly what it did. Only A and B
have gradients and AdamW state, which is the whole saving: at rank 8 that is well under 2 % of the weights.
The names (lora_A, lora_B, scaling, kaiming-uniform A, zero B) are PEFT's, so an adapter exports to PEFT's
format by renaming alone (`hf_adapter`).

QLoRA goes further and stores every frozen matrix of the base in NF4 (`kernels/nf4.py`: 4 bits per weight, an
8-bit absmax per 64, a float per 256 absmaxes, ~0.52 bytes per weight): the block projections and the token
embedding, which a tied LM head shares. A frozen NF4 linear dequantises its weight in forward and again in
backward (`_NF4Linear`) instead of keeping the full-precision copy between them: activations stay the only
thing that grows with the batch. The gradient reaches the input (and through it the adapters), never the
codes. Norm gains and biases stay as they are (a few thousand numbers).

Trainable token rows (PEFT's `trainable_token_indices`): a chat's special tokens (<|im_start|>, <|im_end|>) never
occur in pretraining text, so their embedding rows are untrained, and LoRA on the projections cannot move a row
the attention reads as input. `TrainableTokens` trains just those rows of the frozen embedding (NF4 or not): the
rows' new values are a parameter (PEFT's `trainable_tokens_delta`, which despite its name holds values, not
differences, and starts as the original rows), put in place of the table's rows at lookup. A tied LM head reads
the same table with the rows in place (`TokensHead`), as PEFT ties the head's adapter to the embedding's; an
untied head is left alone, as PEFT leaves it.

What a stage saves is `merged_state_dict`: W + (alpha/rank) B A in float32, with W dequantised for QLoRA, so the
output is a plain kiln model computing what the adapted model computed, and evaluate, generate, chat and
convert need nothing new. The adapter alone (`adapter_state_dict`) is saved beside it.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.model.adapter_spec import TARGETS, TOKEN_ROWS
from kiln.model.gpt import GPT

NF4_BLOCK = 64  # weights per absmax: a quantised matrix's rows must hold whole blocks


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path) if path else model, leaf


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on x runs in: autocast's when it is on, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class NF4Weight(nn.Module):
    """One frozen matrix in NF4. Calling it returns the matrix dequantised to a dtype.

    The 4-bit codes and 8-bit absmaxes (all but 4 bytes in 16,384 of it) are parameters that never require a
    gradient: the optimizer passes them by, and FSDP2 shards them across ranks like any other weight, gathering a
    block's codes only while it computes. The float32 scales and the offset are buffers, whole on every rank,
    which also keeps them out of FSDP's mixed-precision cast (a bf16 scale would change every weight)."""

    def __init__(self, weight: torch.Tensor, backend: str):
        super().__init__()
        from kiln.kernels.nf4 import quantize_nf4

        codes = quantize_nf4(weight.detach())
        for key in ("packed", "absmax"):
            self.register_parameter(key, nn.Parameter(codes[key], requires_grad=False))
        for key in ("absmax_scale", "absmax_offset"):
            self.register_buffer(key, codes[key])
        self.shape, self.dtype, self.backend = tuple(weight.shape), weight.dtype, backend

    def codes(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.absmax, self.absmax_scale, self.absmax_offset

    def forward(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        from kiln.kernels.nf4 import dequantize_nf4

        return dequantize_nf4(*self.codes(), self.shape, dtype or self.dtype, backend=self.backend)


class _NF4Linear(torch.autograd.Function):
    """x @ dequant(codes)^T, with the dequantised weight recomputed in backward rather than saved: saved
    tensors are the 4-bit codes, which the layer holds anyway."""

    @staticmethod
    def forward(ctx, x, packed, absmax, absmax_scale, absmax_offset, shape, backend):
        from kiln.kernels.nf4 import dequantize_nf4

        dtype = compute_dtype(x)
        ctx.save_for_backward(packed, absmax, absmax_scale, absmax_offset)
        ctx.shape, ctx.backend, ctx.dtype, ctx.x_dtype = shape, backend, dtype, x.dtype
        weight = dequantize_nf4(packed, absmax, absmax_scale, absmax_offset, shape, dtype, backend=backend)
        return x.to(dtype) @ weight.T

    @staticmethod
    def backward(ctx, grad):
        from kiln.kernels.nf4 import dequantize_nf4

        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        weight = dequantize_nf4(*ctx.saved_tensors, ctx.shape, ctx.dtype, backend=ctx.backend)
        return (grad.to(ctx.dtype) @ weight).to(ctx.x_dtype), None, None, None, None, None, None


class NF4Linear(nn.Module):
    """A frozen nn.Linear stored in NF4. `weight` is the dequantised matrix (what the fused LM head and the
    chunked log-probabilities read), made on demand and never kept."""

    def __init__(self, quantized: NF4Weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.quantized = quantized
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.quantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        y = _NF4Linear.apply(x, *q.codes(), q.shape, q.backend)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class NF4Embedding(nn.Module):
    """A frozen token embedding stored in NF4: the lookup dequantises the table (frozen, so nothing is saved for
    backward)."""

    def __init__(self, quantized: NF4Weight):
        super().__init__()
        self.quantized = quantized

    @property
    def weight(self) -> torch.Tensor:
        return self.quantized()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.quantized())


class TrainableTokens(nn.Module):
    """A frozen embedding (nn.Embedding or NF4Embedding) whose rows `ids` train."""

    def __init__(self, base: nn.Module, ids: list[int]):
        super().__init__()
        table = base.weight.detach()
        self.base = base
        self.register_buffer("token_indices", torch.tensor(ids, dtype=torch.long, device=table.device))
        # the start's rows, kept to export the base PEFT puts these rows back onto (QLoRA: dequantised)
        self.register_buffer("trainable_tokens_original", table[self.token_indices].clone())
        self.trainable_tokens_delta = nn.Parameter(table[self.token_indices].clone())
        slot = torch.full((table.shape[0],), -1, dtype=torch.long, device=table.device)
        slot[self.token_indices] = torch.arange(len(ids), device=table.device)
        self.register_buffer("slot", slot, persistent=False)  # token id -> its trained row, -1 for the others
        self.enabled = True

    @property
    def weight(self) -> torch.Tensor:
        """The table with the trained rows in place (what a tied LM head multiplies by)."""
        table = self.base.weight
        if not self.enabled:
            return table
        return table.index_copy(0, self.token_indices, self.trainable_tokens_delta.to(table.dtype))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.base(idx)
        if not self.enabled:
            return out
        slot = self.slot[idx]
        trained = self.trainable_tokens_delta[slot.clamp(min=0)].to(out.dtype)
        return torch.where((slot >= 0).unsqueeze(-1), trained, out)


class TokensHead(nn.Module):
    """A tied LM head over a TrainableTokens embedding: logits = x @ (table with the trained rows)^T. The
    embedding is not registered as a submodule here, so its parameters and state are listed once, under tok_emb."""

    def __init__(self, tokens: TrainableTokens):
        super().__init__()
        self._tokens = [tokens]

    @property
    def weight(self) -> torch.Tensor:
        return self._tokens[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(compute_dtype(x)))


class LoRALinear(nn.Module):
    """base(x) + scaling * lora_B(lora_A(dropout(x))), base frozen (an nn.Linear or an NF4Linear)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float):
        super().__init__()
        weight = base.weight
        out_features, in_features = weight.shape
        self.base = base
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=weight.device, dtype=weight.dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=weight.device, dtype=weight.dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init: A random, B zero
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout)
        self.enabled = True

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def delta(self) -> torch.Tensor:
        """The adapter's (out, in) update, scaling included, in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.enabled:
            return y
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def check_adapter(model: GPT, adapter: str, targets: list[str], rank: int,
                  trainable_tokens: list[int] = ()) -> str | None:
    """None, or what is wrong with adapting this model so: ("lora_targets: 'gate_proj' ..."), checked before a
    byte is allocated: a rank is at most the smaller side of every matrix it adapts (a higher one adds nothing a
    full update does not, and lora_rank=1000000 grew to 12.7 GB before it was killed)."""
    block = model.blocks[0]
    have = {t: m for t in TARGETS if isinstance(m := getattr(block.attn, t, None) or getattr(block.mlp, t, None),
                                                 nn.Linear)}
    for t in targets:
        if t not in have:
            return f"lora_targets: {t!r} is not a projection of this {model.config.arch} model ({', '.join(have)})"
    smallest = min(targets, key=lambda t: min(have[t].weight.shape))
    out_features, in_features = have[smallest].weight.shape
    if rank > min(out_features, in_features):
        return (f"lora_rank={rank}: expected at most {min(out_features, in_features)}, the smaller side of "
                f"{smallest} ({out_features} x {in_features}); a higher rank adds nothing a full update does not")
    wrong = next((i for i in trainable_tokens if not 0 <= i < model.config.vocab_size), None)
    if wrong is not None:
        return (f"lora_trainable_tokens: token id {wrong} is not in the model's vocabulary "
                f"(0..{model.config.vocab_size - 1})")
    if adapter == "qlora":
        c = model.config
        for name, size in (("d_model", c.d_model), ("d_ff", c.ffn_dim), ("n_head x head_dim", c.n_head * c.head_dim)):
            if size % NF4_BLOCK:
                return (f"adapter: qlora stores rows in blocks of {NF4_BLOCK} weights, and the model's {name}={size} "
                        f"is not a multiple of {NF4_BLOCK}")
    return None


def apply_adapter(model: GPT, adapter: str, rank: int, alpha: float, dropout: float,
                  targets: list[str], trainable_tokens: list[int] = ()) -> GPT:
    """Freeze `model` and put LoRA on the `targets` of every block (QLoRA: with its frozen matrices in NF4),
    and train the embedding rows `trainable_tokens`. In place; returns the model. "full" returns it untouched.
    Raises ValueError from check_adapter."""
    if adapter == "full":
        return model
    if (problem := check_adapter(model, adapter, targets, rank, trainable_tokens)) is not None:
        raise ValueError(problem)
    model.requires_grad_(False)
    if adapter == "qlora":
        _quantize(model)
    for name, module in list(model.named_modules()):
        if name.startswith("blocks.") and name.rpartition(".")[2] in targets:
            parent, leaf = _parent(model, name)
            setattr(parent, leaf, LoRALinear(module, rank, alpha, dropout))
    if trainable_tokens:
        model.tok_emb = TrainableTokens(model.tok_emb, sorted(trainable_tokens))
        if model.config.tie_embeddings:
            model.lm_head = TokensHead(model.tok_emb)
    return model


def _quantize(model: GPT) -> None:
    """Every block projection and the token embedding into NF4; a tied LM head shares the embedding's codes."""
    backend = model.backend
    for name, module in list(model.named_modules()):
        if name.startswith("blocks.") and isinstance(module, nn.Linear):
            parent, leaf = _parent(model, name)
            setattr(parent, leaf, NF4Linear(NF4Weight(module.weight, backend), module.bias))
    table = NF4Weight(model.tok_emb.weight, backend)
    tied = model.config.tie_embeddings
    model.tok_emb = NF4Embedding(table)
    model.lm_head = NF4Linear(table if tied else NF4Weight(model.lm_head.weight, backend))


ADAPTED = (LoRALinear, TrainableTokens, TokensHead, NF4Linear, NF4Embedding)


def is_adapted(model: nn.Module) -> bool:
    return any(isinstance(m, ADAPTED) for m in model.modules())


def _replaced(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost adapter or NF4 modules by name (a LoRALinear, not also the NF4Linear inside it)."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ADAPTED) and not any(name.startswith(p + ".") for p in out):
            out[name] = module
    return out


@torch.no_grad()
def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The plain GPT state dict this adapted model computes: adapters added into their (dequantised) bases, in
    float32 (a tied LM head's entry equals the embedding's; save_model stores it once). `state`: the model's
    state dict when it was gathered elsewhere (FSDP's, whole on rank 0); by default the model's own."""
    state = model.state_dict() if state is None else state
    replaced = _replaced(model)
    out = {k: v for k, v in state.items() if not any(k.startswith(p + ".") for p in replaced)}
    for name, module in replaced.items():
        if isinstance(module, TokensHead):  # the tied embedding's merged table, set below
            continue
        wrapped = isinstance(module, (LoRALinear, TrainableTokens))
        base_name, base = (f"{name}.base", module.base) if wrapped else (name, module)
        weight = _dense(state, base_name, base)
        if isinstance(module, LoRALinear):
            a, b = state[f"{name}.lora_A.weight"].float(), state[f"{name}.lora_B.weight"].float()
            weight = weight + (b @ a).to(weight.device) * module.scaling
        if isinstance(module, TrainableTokens):
            rows = state[f"{name}.trainable_tokens_delta"].float().to(weight.device)
            weight = weight.index_copy(0, state[f"{name}.token_indices"].to(weight.device), rows)
        out[f"{name}.weight"] = weight
        if f"{base_name}.bias" in state:
            out[f"{name}.bias"] = state[f"{base_name}.bias"]
    for name, module in replaced.items():
        if isinstance(module, TokensHead):
            out[f"{name}.weight"] = out["tok_emb.weight"]
    return out


def _dense(state: dict[str, torch.Tensor], name: str, base: nn.Module) -> torch.Tensor:
    """The float32 matrix of the frozen module `name` in `state`: an nn.Linear's weight, or NF4 codes decoded."""
    if isinstance(base, (NF4Linear, NF4Embedding)):
        from kiln.kernels.nf4 import KEYS, dequantize_nf4

        codes = [state[f"{name}.quantized.{key}"] for key in KEYS]
        return dequantize_nf4(*codes, base.quantized.shape, torch.float32)
    return state[f"{name}.weight"].float()


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lora_A / lora_B of every adapted projection, and the trained token rows with their originals, in an adapted
    model's state dict, on the CPU."""
    return {k: v.detach().cpu().contiguous() for k, v in state.items()
            if ".lora_A." in k or ".lora_B." in k or k.rpartition(".")[2] in TOKEN_ROWS}


def set_adapters(model: nn.Module, enabled: bool) -> None:
    """Switch the adapters and trained token rows off (the frozen base alone: the model training started from) or
    back on."""
    for module in model.modules():
        if isinstance(module, (LoRALinear, TrainableTokens)):
            module.enabled = enabled


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The frozen base alone inside the block (GRPO's reference without a second copy of the model)."""
    set_adapters(model, False)
    try:
        yield model
    finally:
        set_adapters(model, True)
