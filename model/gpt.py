"""The transformer: one config, one code path, two architectures.

`arch="llama"` is the modern recipe (pre-norm RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention,
no biases); `arch="gpt2"` is the 2019 one (LayerNorm, GELU MLP, learned positions, biases, tied embeddings).
They differ in four small places, each a plain `if` on the config, so a reader can diff them by eye and an
ablation is one config field. `norm` swaps the normalisation alone: the arch's own (auto), RMSNorm, LayerNorm,
or Dynamic Tanh (Zhu et al. 2025, "Transformers without Normalization").

The same `forward` serves training (full sequences, causal SDPA, loss) and generation (a few new tokens
appended to a preallocated `KVCache`). It has no Python branches on tensor values, so `torch.compile` traces
it in one graph.

`GPT.set_kernels("auto" | "triton" | "torch")` is the one switch to kiln's Triton kernels: RMSNorm, SwiGLU,
RoPE, flash attention (training and prefill without a cache) and the fused LM head + cross-entropy. "torch"
(the default) runs the plain-torch code below; "auto" takes the kernels for CUDA tensors only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# Only the backend switch at import: the kernel modules import Triton, which macOS and Windows lack, so each is
# imported where a fused path is taken (and Triton is there).
from kiln.kernels.backend import BACKENDS, use_triton
from kiln.model.config import ModelConfig
from kiln.model.logprobs import TokenStats, softcap, token_logprobs
from kiln.model.packed import Packed
from kiln.model.paged import PagedCache

REDUCTIONS = ("mean", "sum", "none")


class KVCache:
    """Keys and values of every layer for positions [0, max_len), allocated once.

    A static shape (n_layer, batch, n_kv_head, max_len, head_dim) means decoding never reallocates or
    concatenates, and only the n_kv_head heads are stored (GQA's memory saving). Position p is written when
    token p is fed and attention reads only [0, pos+T), so stale entries are never seen: a cache can be reused
    for a new sequence (starting again at pos=0) without clearing it.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device=None, dtype=None):
        if not 0 < max_len <= config.max_seq_len:
            raise ValueError(f"max_len: {max_len} is not in [1, max_seq_len={config.max_seq_len}]")
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, n_kv_head, T, head_dim) at positions [pos, pos+T); return all keys/values so far."""
        B, T = k.size(0), k.size(2)
        if B != self.batch_size or pos + T > self.max_len:
            raise ValueError(f"cache holds batch {self.batch_size} x {self.max_len} positions, "
                             f"got batch {B} at positions [{pos}, {pos + T})")
        self.k[layer, :, :, pos:pos + T] = k
        self.v[layer, :, :, pos:pos + T] = v
        return self.k[layer, :, :, :pos + T], self.v[layer, :, :, :pos + T]


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of position·frequency, (max_seq_len, head_dim/2), in float32 so far positions keep precision."""
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x1[i], x2[i]) pair by its angle; x is (B, H, T, head_dim), cos/sin are (T, head_dim/2), or
    (B, 1, T, head_dim/2) when each row has its own positions.

    Pairs are the two halves of the head (HF Llama's "rotate_half" layout, not interleaved), so Llama weights
    convert without permuting q/k rows. The dot product q·k then depends only on the distance between tokens.
    """
    # at least float32 (bf16 would lose the angle's precision), float64 kept: float64 checks compare sums of
    # gradients that a float32 rotation would round differently
    x1, x2 = x.to(torch.promote_types(x.dtype, torch.float32)).chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Mask(NamedTuple):
    """What a forward's queries may see: SDPA's attn_mask and is_causal and, for packed sequences that share
    nothing, their segment ids (B, T), which kiln's flash kernel takes instead of the (B, 1, T, T) mask that holds
    the same for SDPA."""

    attn_mask: torch.Tensor | None
    is_causal: bool
    segments: torch.Tensor | None = None


def attention_mask(pos: int, T: int, pad: torch.Tensor | None, device) -> Mask:
    """(attn_mask, is_causal) for T new queries in cache slots [pos, pos+T) over keys in slots [0, pos+T).

    Without padding: SDPA's is_causal aligns the triangle to the top-left, which is right only when queries and
    keys start together (pos == 0); a single new token may see every key, so needs no mask; otherwise (a chunk
    after a prefix) query pos+i may see keys 0..pos+i, an explicit boolean mask (True = may attend).

    With `pad` (B,), row b's first pad[b] slots hold left padding that no query may see. A query that is itself
    padding sees only its own slot: an SDPA row with no key at all is NaN, which would become the next layer's
    key/value at that slot and poison every real row through 0 * NaN in the attention product.
    """
    if pad is None:
        if pos == 0:
            return Mask(None, T > 1)
        if T == 1:
            return Mask(None, False)
        q_slot = torch.arange(pos, pos + T, device=device)
        return Mask(q_slot[:, None] >= torch.arange(pos + T, device=device)[None, :], False)
    q_slot = torch.arange(pos, pos + T, device=device)[:, None]
    k_slot = torch.arange(pos + T, device=device)[None, :]
    real = k_slot >= pad.view(-1, 1, 1, 1)  # (B, 1, 1, S)
    return Mask(((k_slot <= q_slot) & real) | (k_slot == q_slot), False)


def positions(pos: int, T: int, pad: torch.Tensor | None, device) -> torch.Tensor:
    """Token positions of slots [pos, pos+T): (T,), or (B, T) with left padding (row b starts at slot pad[b];
    its padding gets position 0, which no real token attends to)."""
    slots = torch.arange(pos, pos + T, device=device)
    return slots if pad is None else (slots[None, :] - pad[:, None]).clamp(min=0)


class Attention(nn.Module):
    backend = "torch"  # set by GPT.set_kernels

    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = config.arch == "gpt2"
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.d_model, config.n_head * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.d_model, config.n_kv_head * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.d_model, config.n_kv_head * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=bias)
        # QK-norm bounds every attention logit by the gains (|q·k| <= |g_q||g_k|·sqrt(head_dim)), the logit
        # growth that makes a high learning rate diverge; Qwen3's layout: one gain per head channel, before RoPE.
        self.q_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x, rope, cache: KVCache | PagedCache | None, layer: int, pos: int, mask) -> torch.Tensor:
        B, T, _ = x.shape
        fused = use_triton(self.backend, x)
        attn_mask, is_causal, segments = Mask(*mask)
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim)
        # Per-row positions (left padding) come as (B, 1, T, D/2) tables, which the kernel does not take.
        if rope is not None and fused and rope[0].dim() == 2:
            from kiln.kernels.rope import rope as rotate

            q, k = rotate(q, k, *rope, backend="triton")
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None and not (fused and rope[0].dim() == 2):
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if fused and cache is None and (attn_mask is None or segments is not None) and \
                not (self.training and self.dropout):
            # Reads each kv head in place for its query heads: no GQA copy.
            from kiln.kernels.flash_attention import flash_attention

            y = flash_attention(q, k, v, causal=True, backend="triton", segments=segments)
            return self.resid_drop(self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)))
        if isinstance(cache, PagedCache):  # it stores and attends itself
            y = cache.attend(layer, q, k, v)
            return self.resid_drop(self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)))
        if cache is not None:
            k, v = cache.update(layer, pos, k, v)
        if self.n_kv_head != self.n_head:
            # GQA: query head h reads kv head h // n_rep (HF's repeat_kv layout). SDPA's enable_gqa would
            # avoid the copy but is missing from some torch versions we support.
            n_rep = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.resid_drop(self.o_proj(y))


class MLP(nn.Module):
    """llama: down(silu(gate(x)) * up(x)) (SwiGLU); gpt2: down(gelu(up(x))) with GPT-2's tanh-approximate GELU;
    `mlp: relu2` (either arch): down(relu(up(x))^2), modded-nanogpt's, ungated (So et al. 2021, Primer)."""

    backend = "torch"

    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = config.arch == "gpt2"
        d, f = config.d_model, config.ffn_dim
        self.relu2 = config.mlp == "relu2"
        self.gate_proj = nn.Linear(d, f, bias=False) if config.gated else None
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None and use_triton(self.backend, x):
            from kiln.kernels.swiglu import swiglu

            h = swiglu(self.gate_proj(x), self.up_proj(x), backend="triton")
        elif self.gate_proj is not None:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        elif self.relu2:
            h = F.relu(self.up_proj(x)).square()
        else:
            h = F.gelu(self.up_proj(x), approximate="tanh")
        return self.resid_drop(self.down_proj(h))


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same state-dict key) that can run the fused kernel."""

    backend = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(self.backend, x):
            from kiln.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, backend="triton")
        if x.dtype != self.weight.dtype:
            # QK-norm's input is a matmul's output, 16-bit under autocast: torch's fused kernel wants one dtype
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
        return super().forward(x)


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al. 2025): weight * tanh(alpha * x) + bias, with alpha one learnable scalar.

    Layer norms in trained transformers map their inputs through an S-shaped curve, tanh-like for the outliers;
    DyT is that curve without the per-token statistics, so it needs no reduction over the channels. alpha starts
    at the paper's default 0.5 (which it tunes per model for LLMs), the affine at the identity, as a norm's.
    """

    ALPHA_INIT = 0.5

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(1))
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.ALPHA_INIT)
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x) * self.weight + self.bias


def make_norm(config: ModelConfig) -> nn.Module:
    kind = config.norm_kind
    if kind == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    if kind == "layernorm":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps)
    return DyT(config.d_model)


class Block(nn.Module):
    """Pre-norm residual block: the residual stream is never normalised, which keeps deep stacks trainable."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope, cache: KVCache | PagedCache | None, layer: int, pos: int, mask) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache, layer, pos, mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    # Output projections that write into the residual stream; see init_weights.
    RESIDUAL_PROJECTIONS = ("attn.o_proj.weight", "mlp.down_proj.weight")
    backend = "torch"
    checkpointing = False  # set by set_checkpointing

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config.check().check_fits(torch.get_default_device())
        c = config
        self.tok_emb = nn.Embedding(c.padded_vocab_size, c.d_model)
        # DyT does not rescale its input as a norm does, and embeddings start at std 0.02: the authors' LLaMA
        # code multiplies them by a learnable scalar that starts at sqrt(d_model) (without it this model stays
        # at the unigram loss, measured: docs/stages.md).
        self.emb_scale = nn.Parameter(torch.empty(1)) if c.norm_kind == "dyt" else None
        self.pos_emb = nn.Embedding(c.max_seq_len, c.d_model) if c.arch == "gpt2" else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = make_norm(c)
        self.lm_head = nn.Linear(c.d_model, c.padded_vocab_size, bias=False)
        if c.tie_embeddings:
            # One matrix reads tokens in and scores them out: saves V·d parameters, and is what GPT-2 did.
            self.lm_head.weight = self.tok_emb.weight
        if c.arch == "llama":
            # Derived from the config, so not saved in checkpoints (persistent=False).
            cos, sin = rope_tables(c)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def set_kernels(self, backend: str, ops: tuple[str, ...] | None = None) -> GPT:
        """Route every fusable op through kernels/ ("triton"), only on CUDA ("auto"), or never ("torch").
        `ops`: only these of KERNEL_OPS take `backend`, the others torch's (a benchmark's split of a step's time
        by op); None: all of them."""
        if backend not in BACKENDS:
            raise ValueError(f"kernels: {backend!r} is not one of {', '.join(BACKENDS)}")
        unknown = sorted(set(ops or ()) - set(KERNEL_OPS))
        if unknown:
            raise ValueError(f"kernel ops: {', '.join(unknown)} not among {', '.join(KERNEL_OPS)}")
        for module in self.modules():
            for op, kind in KERNEL_OPS.items():
                if isinstance(module, kind):
                    module.backend = backend if ops is None or op in ops else "torch"
        return self

    def set_checkpointing(self, on: bool) -> GPT:
        """Activation checkpointing: in training, each block keeps only its input for the backward and runs its
        forward again there, trading a second forward of the blocks for their activations' memory."""
        self.checkpointing = on
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's init: N(0, 0.02) for every matrix and embedding, zero biases, unit norm weights.

        Each block adds two outputs (attention, MLP) to the residual stream, so its variance grows with
        2·n_layer additions; scaling those two projections by 1/sqrt(2·n_layer) keeps the stream's scale at
        init independent of depth (`zero_init`: zero instead).
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm, DyT)):
                module.reset_parameters()
        if self.emb_scale is not None:
            nn.init.constant_(self.emb_scale, math.sqrt(self.config.d_model))
        for name, p in self.named_parameters():
            if name.endswith(self.RESIDUAL_PROJECTIONS) and self.config.zero_init:
                # modded-nanogpt's: every block starts as the identity and the stream as the embeddings; the
                # projections' gradients are not zero (their inputs are not), so they leave zero at the first step
                nn.init.zeros_(p)
            elif name.endswith(self.RESIDUAL_PROJECTIONS):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                cache: KVCache | PagedCache | None = None, pos: int = 0, pad: torch.Tensor | None = None,
                reduction: str = "mean", temperature: float = 1.0, stats: bool = False,
                packed: Packed | None = None) -> torch.Tensor | TokenStats:
        """idx (B, T) token ids at positions [pos, pos+T).

        Without targets: logits (B, T, vocab_size) — the padded vocabulary rows are cut off, so they can never
        be predicted or sampled. With targets (B, T) int64: the cross-entropy in float32, ignoring -100;
        reduction "mean" (over non-ignored tokens), "sum", or "none" ((B, T), 0 where ignored).
        With a cache, keys/values of the new tokens are stored at [pos, pos+T) and attention covers [0, pos+T).
        A `PagedCache` (the serving engine's) instead brings a flat batch of several
        sequences' new tokens (B = 1): their positions, where to store them, what each attends to, and
        `logit_rows`, the tokens whose logits are returned ((1, len(logit_rows), vocab_size)).
        `pad` (B,) int64 batches sequences of different lengths by left padding: row b's first pad[b] slots
        (of the cache, or of idx without one) are padding, never attended to, and its tokens' positions count
        from slot pad[b], so each row computes what it would alone.
        `packed` lays several sequences in each row (model/packed.py; no cache, no pad): packed documents or
        examples, and prompts stored once before the answers that share them. Each token attends to what it would
        see alone and has the position it would have there, so each sequence computes what it would alone.
        Per-token results never hold the (B·T, vocab) logits: reduction "none" and `stats` run the head a chunk
        of tokens at a time (model/logprobs.py). `stats=True` returns TokenStats of (B, T) tensors under
        softmax(logits / temperature): log p(target), the entropy, and whether the target is the argmax.
        """
        c = self.config
        B, T = idx.shape
        if isinstance(cache, PagedCache):
            return self._paged_forward(idx, cache)
        # a packed row may be longer than max_seq_len (a prompt and the answers sharing it): its producer keeps
        # every sequence, so every position, within it
        if packed is None and pos + T > c.max_seq_len:
            raise ValueError(f"positions [{pos}, {pos + T}) exceed max_seq_len={c.max_seq_len}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: {reduction!r} is not one of {', '.join(REDUCTIONS)}")
        if pad is not None and pad.shape != (B,):
            raise ValueError(f"pad: expected shape ({B},), got {tuple(pad.shape)}")
        if packed is not None:
            if cache is not None or pad is not None:
                raise ValueError("packed: takes neither a cache nor pad")
            packed.check(B, T)
        x = self.embed(idx)
        at = positions(pos, T, pad, idx.device) if packed is None else packed.positions()
        if self.pos_emb is not None:
            x = x + self.pos_emb(at)
        x = self.drop(x)
        rope = None
        if c.arch == "llama":
            rope = (self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]) if at.dim() == 1 else \
                (self.rope_cos[at][:, None], self.rope_sin[at][:, None])
        mask = attention_mask(pos, T, pad, idx.device) if packed is None else \
            Mask(packed.mask(), False, packed.segments if packed.shares is None else None)
        recompute = self.checkpointing and cache is None and torch.is_grad_enabled()
        for layer, block in enumerate(self.blocks):
            if recompute:  # non-reentrant: the RNG state is replayed, so dropout masks match the first forward
                x = torch.utils.checkpoint.checkpoint(block, x, rope, cache, layer, pos, mask, use_reentrant=False)
            else:
                x = block(x, rope, cache, layer, pos, mask)
        h = self.norm(x)
        if targets is not None and stats:
            return TokenStats(*(t.view(B, T) for t in self._token_logprobs(h, targets, temperature, True)))
        if targets is not None and use_triton(self.backend, h):
            return self._fused_loss(h, targets, reduction)
        if targets is not None and reduction == "none":
            return -self._token_logprobs(h, targets, 1.0, False).view(B, T)
        logits = self.lm_head(h)[..., :c.vocab_size]
        if targets is None:
            return self.softcap(logits)
        # float32 even under autocast: log-softmax over a large vocabulary loses too much in bf16 (so does the cap)
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(self.softcap(wide).reshape(B * T, -1), targets.reshape(B * T),
                               ignore_index=-100, reduction=reduction)
        return loss.view(B, T) if reduction == "none" else loss

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        return x if self.emb_scale is None else x * self.emb_scale

    def _paged_forward(self, idx: torch.Tensor, cache) -> torch.Tensor:
        """The flat batch of a paged cache: per-token positions for the embeddings and RoPE, attention by the
        cache, logits for the rows it asks for only (a prompt's other tokens need none)."""
        at = cache.positions[None]
        x = self.embed(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(at)
        rope = (self.rope_cos[at][:, None], self.rope_sin[at][:, None]) if self.config.arch == "llama" else None
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, cache, layer, 0, Mask(None, False))
        return self.softcap(self.lm_head(self.norm(x[:, cache.logit_rows]))[..., :self.config.vocab_size])

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """`logit_softcap`'s cap * tanh(logits / cap): every logit within (-cap, cap), smoothly (0: as they are)."""
        cap = self.config.logit_softcap
        return softcap(logits, cap) if cap else logits

    def _token_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float, stats: bool):
        # the whole padded weight, told which rows are classes (the padding is never scored): aligned GEMMs
        return token_logprobs(h.reshape(-1, h.shape[-1]), self.lm_head.weight, targets.reshape(-1), temperature,
                              stats, vocab_size=self.config.vocab_size, softcap=self.config.logit_softcap)

    def _fused_loss(self, h: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        """LM head + cross-entropy in token chunks: the (B·T, vocab) logits are never materialised."""
        B, T, D = h.shape
        # The whole padded weight, told which rows are classes: its logits rows stay 16-byte aligned for cuBLAS.
        weight = self.lm_head.weight
        if torch.is_autocast_enabled(h.device.type):  # a custom kernel is not autocast: cast as the matmul would
            dtype = torch.get_autocast_dtype(h.device.type)
            h, weight = h.to(dtype), weight.to(dtype)
        from kiln.kernels.linear_cross_entropy import linear_cross_entropy

        loss = linear_cross_entropy(h.reshape(B * T, D), weight, targets.reshape(B * T), reduction=reduction,
                                    backend="triton", vocab_size=self.config.vocab_size,
                                    softcap=self.config.logit_softcap).float()
        return loss.view(B, T) if reduction == "none" else loss

    def num_params(self, embeddings: bool = True) -> int:
        """Parameters, tied ones counted once. embeddings=False leaves out the token (and gpt2 position)
        embedding tables: the usual "non-embedding" N of scaling laws. An untied LM head stays in."""
        n = sum(p.numel() for p in self.parameters())  # parameters() already yields a tied tensor once
        if not embeddings:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token: 6·N + 12·n_layer·d_model·seq_len (PaLM appendix B,
        as in nanoGPT's estimate_mfu).

        6·N: each parameter in a matmul costs 2 FLOPs forward and 4 backward. N is the non-embedding count
        plus the LM head's d_model·padded_vocab, because that head is a real (and at small scale, the
        largest) matmul even when its weight is the tied embedding; embedding lookups are not matmuls. Norm
        weights and biases are in N too, a negligible overcount. 12·L·d·T: the QK^T and AV products (2 FLOPs
        x 2 matmuls x 3 for fwd+bwd), over the full T keys — causal masking's halving is not subtracted,
        by the same convention, so MFU figures are comparable with other reports.
        """
        c = self.config
        T = c.max_seq_len if seq_len is None else seq_len
        n = self.num_params(embeddings=False)
        if c.tie_embeddings:
            n += c.d_model * c.padded_vocab_size  # otherwise lm_head.weight is already in n
        return 6 * n + 12 * c.n_layer * c.d_model * T


# What GPT.set_kernels(ops=...) can switch one at a time: RMSNorm; the MLP's SwiGLU; attention's RoPE and flash
# attention; the fused LM head + cross-entropy (the GPT module's own backend).
KERNEL_OPS = {"norm": RMSNorm, "mlp": MLP, "attention": Attention, "head": GPT}
