"""Training statistics (`train.stats_every`): what practitioners look at when a run underperforms, per layer.

Every `stats_every` steps, for each block:
- `grad_norm`: the L2 norm of its parameters' gradients (after accumulation, before clipping), per parameter
  group: `attn` (q, k, v, o projections), `mlp`, `norm` (both norms), and the `embed` table;
- `update_ratio`: ||W_after - W_before|| / ||W_before|| of that step's update, per group (~1e-3 is the
  usual healthy value for AdamW; much larger means the lr is too high for the layer, much smaller that it barely
  learns), and per optimizer group (`optimizer.muon`, `optimizer.adamw_decay`, `optimizer.adamw_no_decay`): Muon's
  orthogonalised steps move a matrix by a set spectral size, so its ratio is read beside AdamW's;
- `act_rms` and `act_max`: the RMS and the largest |value| of the block's output (the residual stream);
- `attn_logit_max`: the largest q.k / sqrt(head_dim) of the block's attention (the first sequence of each
  micro-batch, causal positions only): logits that keep growing are the instability QK-norm and soft-capping fix;
- `dead_units`: the share of MLP hidden units that never activate on the step's batch (|h| below 1e-3 of the
  layer's RMS for every token), the "dead neuron" count; exact zeros are rare with SiLU and GELU.

The hooks exist during a stats step only: registered before it, removed after, so the other steps (and every
step with `stats_every: 0`) run the model untouched. Curves go to the run's DVCLive folder as
`stats/<statistic>/<layer>` (`layer_03.attn`, ...), and `draw` makes one heatmap PNG per statistic, layer by step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kiln.model.gpt import GPT, Attention, Mask, apply_rope
from kiln.pipeline.train.curves import metric_files, pyplot, read_metric, save_png

GROUPS = {"attn": ".attn.", "mlp": ".mlp.", "norm": "_norm."}
DEAD = 1e-3
STATISTICS = ("grad_norm", "update_ratio", "act_rms", "act_max", "attn_logit_max", "dead_units")


def optimizer_group_name(group: dict) -> str:
    """muon (a Muon group: it warms its momentum up), adamw_embed or adamw_head (a group of its own lr, named),
    adamw_decay or adamw_no_decay (by its weight decay)."""
    if "momentum_warmup" in group:
        return "muon"
    if "name" in group:
        return f"adamw_{group['name']}"
    return "adamw_decay" if group.get("weight_decay") else "adamw_no_decay"


def find_gpt(model: torch.nn.Module) -> GPT:
    """The GPT inside whatever wraps it (DDP, a LoRA-adapted model is still one)."""
    return next(m for m in model.modules() if isinstance(m, GPT))


def group_of(name: str) -> str | None:
    """'blocks.3.attn.q_proj.weight' -> 'layer_03.attn'; the embedding -> 'embed'; the final norm -> None."""
    if name.startswith("tok_emb.") or name.startswith("pos_emb."):
        return "embed"
    parts = name.split(".")
    if parts[0] != "blocks":
        return None
    for group, marker in GROUPS.items():
        if marker in name:
            return f"layer_{int(parts[1]):02d}.{group}"
    return None


class StepStats:
    """The statistics of one step: `attach` before it, `gradients` after the backward, `updates` after the
    optimizer step, `detach` and `values` at the end."""

    def __init__(self, model: torch.nn.Module):
        self.gpt = find_gpt(model)
        self.handles: list = []
        self.sums: dict[str, float] = defaultdict(float)  # act sum of squares
        self.counts: dict[str, int] = defaultdict(int)
        self.maxima: dict[str, float] = defaultdict(float)
        self.fired: dict[str, torch.Tensor] = {}
        self.values: dict[str, float] = {}
        self.before: dict[str, torch.Tensor] = {}

    def attach(self) -> StepStats:
        for i, block in enumerate(self.gpt.blocks):
            layer = f"layer_{i:02d}"
            self.handles.append(block.register_forward_hook(self._block_hook(layer)))
            self.handles.append(block.attn.register_forward_hook(self._attention_hook(layer)))
            self.handles.append(block.mlp.down_proj.register_forward_pre_hook(self._mlp_hook(layer)))
        return self

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # Hooks skip forwards without gradients (GRPO's rollouts and old-policy scores, DPO's reference model):
    # only the training forward is described.
    def _block_hook(self, layer: str):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return
            out = output.detach().float()
            self.sums[layer] += out.pow(2).sum().item()
            self.counts[layer] += out.numel()
            self.maxima[f"act_max/{layer}"] = max(self.maxima[f"act_max/{layer}"], out.abs().max().item())
        return hook

    def _attention_hook(self, layer: str):
        def hook(module: Attention, args, output):
            if torch.is_grad_enabled() and args[2] is None:
                with torch.no_grad():
                    self._logit_max(layer, module, args[0][:1], args[1], args[5])
        return hook

    def _logit_max(self, layer: str, module: Attention, x: torch.Tensor, rope, mask) -> None:
        T = x.size(1)
        q = module.q_proj(x).view(1, T, module.n_head, module.head_dim)
        k = module.k_proj(x).view(1, T, module.n_kv_head, module.head_dim)
        if module.q_norm is not None:  # QK-norm: the logits the attention computes are the normed ones
            q, k = module.q_norm(q), module.k_norm(k)
        q, k = q.transpose(1, 2).float(), k.transpose(1, 2).float()
        if rope is not None:  # per-row tables (packed documents' positions): the first row's
            rope = tuple(t[:1] if t.dim() == 4 else t for t in rope)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k = k.repeat_interleave(module.n_head // module.n_kv_head, dim=1)
        logits = q @ k.transpose(-1, -2) / math.sqrt(module.head_dim)
        seen = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        attn_mask = Mask(*mask).attn_mask
        if attn_mask is not None:  # packed sequences: the pairs the first row's mask lets attend
            seen = seen & attn_mask[0, 0]
        top = logits.masked_fill(~seen, float("-inf")).max().item()
        key = f"attn_logit_max/{layer}"
        self.maxima[key] = max(self.maxima.get(key, float("-inf")), top)

    def _mlp_hook(self, layer: str):
        def hook(module, args):
            if not torch.is_grad_enabled():
                return
            h = args[0].detach().float().reshape(-1, args[0].size(-1))
            rms = h.pow(2).mean().sqrt().clamp_min(1e-30)
            fired = (h.abs() > DEAD * rms).any(dim=0)
            self.fired[layer] = fired | self.fired[layer] if layer in self.fired else fired
        return hook

    @torch.no_grad()
    def gradients(self) -> None:
        """Per-group gradient norms, and a copy of the trained weights to measure the update by."""
        squares: dict[str, float] = defaultdict(float)
        for name, p in self.gpt.named_parameters():
            if not p.requires_grad:
                continue
            self.before[name] = p.detach().clone()
            group = group_of(name)
            if group is not None and p.grad is not None:
                squares[group] += p.grad.detach().float().pow(2).sum().item()
        self.values.update({f"grad_norm/{g}": math.sqrt(v) for g, v in squares.items()})

    @torch.no_grad()
    def updates(self, param_groups: list[dict] = ()) -> None:
        """The update ratios of the step just taken, per layer group and per optimizer group of `param_groups`."""
        change: dict[str, float] = defaultdict(float)
        weight: dict[str, float] = defaultdict(float)
        optimizer_group = {id(p): f"optimizer.{optimizer_group_name(group)}" for group in param_groups
                           for p in group["params"]}
        for name, p in self.gpt.named_parameters():
            if name not in self.before:
                continue
            moved = (p.detach().float() - self.before[name].float()).pow(2).sum().item()
            size = self.before[name].float().pow(2).sum().item()
            for group in (group_of(name), optimizer_group.get(id(p))):
                if group is not None:
                    change[group] += moved
                    weight[group] += size
        self.values.update({f"update_ratio/{g}": math.sqrt(change[g] / weight[g]) for g in change if weight[g]})
        self.before = {}

    def results(self) -> dict[str, float]:
        """Every statistic of the step, `stats/<statistic>/<layer>` -> value."""
        out = dict(self.values)
        out.update({f"act_rms/{layer}": math.sqrt(self.sums[layer] / n) for layer, n in self.counts.items()})
        out.update(self.maxima)
        out.update({f"dead_units/{layer}": 1.0 - fired.float().mean().item() for layer, fired in self.fired.items()})
        return {f"stats/{k}": v for k, v in out.items()}


@contextmanager
def observing(model: torch.nn.Module, on: bool) -> Iterator[StepStats | None]:
    """StepStats attached to `model` for one step when `on` (None otherwise), detached after it whatever happens:
    the loop and `kiln bench train` take their statistics steps through this."""
    if not on:
        yield None
        return
    stats = StepStats(model).attach()
    try:
        yield stats
    finally:
        stats.detach()


def draw(curves_dir: Path) -> list[Path]:
    """One heatmap per statistic logged in `curves_dir`: a row per layer (and group), a column per stats step,
    colour the value (log10 for norms, ratios and maxima, which span decades)."""
    plt = pyplot()
    files = metric_files(curves_dir)
    written = []
    for stat in STATISTICS:
        rows = sorted(name for name in files if name.startswith(f"stats/{stat}/"))
        if not rows:
            continue
        series = {name: dict(read_metric(files[name])) for name in rows}
        steps = sorted({s for points in series.values() for s in points})
        log = stat not in ("dead_units", "attn_logit_max")
        grid = [[_scale(series[name].get(s, float("nan")), log) for s in steps] for name in rows]
        # laid out from the start: a colorbar added before the layout engine is set breaks constrained layout
        fig, ax = plt.subplots(figsize=(min(14, 5 + 0.12 * len(steps)), max(2.8, 1.4 + 0.3 * len(rows))),
                               layout="constrained")
        finite = [v for row in grid for v in row if math.isfinite(v)] or [0.0]
        low, high = min(finite), max(finite)
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                          vmin=low - 0.5 if low == high else low, vmax=high + 0.5 if low == high else high,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5))
        ax.set_yticks(range(len(rows)), [name.split("/", 2)[2] for name in rows], fontsize=7)
        ax.set(xlabel="step", title=f"{stat}{' (log10)' if log else ''}")
        fig.colorbar(image, ax=ax)
        (curves_dir / "stats").mkdir(parents=True, exist_ok=True)
        written.append(save_png(fig, curves_dir / "stats" / f"{stat}.png"))
    return written


def _scale(value: float, log: bool) -> float:
    if not log:
        return value
    return math.log10(value) if value > 0 else float("nan")
