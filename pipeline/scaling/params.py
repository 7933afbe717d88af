"""The `scaling` section, which the sweep, the fit's bootstrap and the size choice read.

The sweep trains with its own copy of the optimiser and precision keys (`scaling.lr`, `scaling.precision`, ...,
by default the same values as `train.*`), so that an experiment on pretraining (`-S train.precision=bf16`)
reruns pretraining and what follows, not the twelve sweep runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kiln.pipeline.config import Section, build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.train.params import TrainParams, loop_keys

# Beyond any training run there has been (~1e25 FLOPs); a bound keeps C^a and C/(6N) far from overflow.
MAX_FLOPS = 1e30
MAX_BOOTSTRAP = 10_000  # each resample is a full fit (~0.3 s)


@dataclass
class ScalingParams(Section):
    """The IsoFLOP sweep (budgets x depths), the fit's bootstrap, and the budget `model.size: auto` sizes for.

    A depth L gives a model of d_model = aspect * L and n_head = d_model / head_dim; the rest of the shape
    comes from the `model` section. The keys it shares with `train` (batch_tokens, eval_tokens and those after
    `approach`) are the training loop's, for the sweep alone (the sweep sets each run's length, batch and eval)."""

    SECTION: ClassVar[str] = "scaling"
    budgets: list[float] = dataclasses.field(default_factory=lambda: [1e11, 1.5e11, 2e11])
    depths: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 3, 4])
    aspect: int = 8
    head_dim: int = 8
    batch_tokens: int = 1024
    warmup_fraction: float = 0.05
    eval_tokens: int = 32768
    bootstrap: int = 100
    target_flops: float = 1e13
    approach: str = "isoflop"  # which fit sizes model.size=auto: isoflop (N_opt = k C^a) | parametric (L(N, D))
    seed: int = 1337
    device: str = "auto"
    precision: str = "fp32"
    kernels: str = "torch"
    compile: bool = False
    batch_size: int = 16
    lr: float = 1e-2
    min_lr: float = 1e-3
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    embed_lr: float | None = None
    head_lr: float | None = None
    optimizer: str = "muon"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85
    muon_momentum_warmup: int = 300
    muon_weight_decay: float = 0.0
    stats_every: int = 0

    def check(self) -> None:
        if len(set(self.budgets)) < 2 or not all(0 < c <= MAX_FLOPS for c in self.budgets):
            raise self.bad("budgets", f"at least 2 different FLOP budgets in (0, {MAX_FLOPS:g}] (the fit needs 2 "
                                      "IsoFLOP profiles)")
        if len(set(self.depths)) < 3 or not all(d > 0 for d in self.depths):
            raise self.bad("depths", "at least 3 different positive depths (a parabola needs 3 points per budget)")
        if self.head_dim < 2 or self.head_dim % 2:
            raise self.bad("head_dim", "an even integer >= 2")
        if self.aspect < 1 or self.aspect % self.head_dim:
            raise self.bad("aspect", f"a positive multiple of scaling.head_dim={self.head_dim}")
        for name in ("batch_tokens", "eval_tokens"):
            if getattr(self, name) < 1:
                raise self.bad(name, "a positive integer")
        if not 0 <= self.bootstrap <= MAX_BOOTSTRAP:
            raise self.bad("bootstrap", f"0 (no intervals) to {MAX_BOOTSTRAP} resamples")
        if not 0 <= self.warmup_fraction < 1:
            raise self.bad("warmup_fraction", "a number in [0, 1)")
        if not 0 < self.target_flops <= MAX_FLOPS:
            raise self.bad("target_flops", f"a number of FLOPs in (0, {MAX_FLOPS:g}]")
        if self.approach not in ("isoflop", "parametric"):
            raise self.bad("approach", "'isoflop' or 'parametric'")
        self.train_params()

    def train_params(self) -> TrainParams:
        """The loop's settings every sweep run starts from (the sweep sets its length, batch and eval), checked
        by TrainParams' own rules and reported under their scaling.* names."""
        try:
            return build_section(TrainParams, loop_keys(self))
        except UserError as e:
            raise UserError(str(e).replace("params: train.", "params: scaling.", 1)) from None

    def shape(self, depth: int) -> dict[str, int]:
        """The depth dial: width grows with depth at a fixed aspect ratio, heads keep a fixed size."""
        d_model = self.aspect * depth
        return {"n_layer": depth, "d_model": d_model, "n_head": d_model // self.head_dim,
                "n_kv_head": d_model // self.head_dim, "d_ff": 0}
