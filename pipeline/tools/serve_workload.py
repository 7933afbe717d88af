"""The serving benchmarks' workload: requests at Poisson arrivals, prompts and output lengths drawn from a seed
(`kiln bench serve`, and its HTTP load test)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.model.config import ModelConfig


@dataclass
class Workload:
    arrivals: list[float]  # seconds after the start
    prompts: list[list[int]]
    outputs: list[int]  # tokens each request generates


OUTPUT_LENGTHS = ("geometric", "uniform")


def workload(n: int, rate: float, config: ModelConfig, seed: int, shared: int = 0,
             output_lengths: str = "geometric") -> Workload:
    """`n` requests at Poisson arrivals; `shared` > 0 opens every prompt with the same `shared` tokens."""
    rng = np.random.default_rng(seed)
    context = config.max_seq_len
    system = rng.integers(config.vocab_size, size=shared).tolist()
    prompts, outputs = [], []
    for _ in range(n):
        length = int(rng.integers(8, max(9, context // 2 + 1)))
        prompts.append(system + rng.integers(config.vocab_size, size=length).tolist())
        room = context + 1 - len(prompts[-1])
        drawn = rng.geometric(1 / max(2, context // 8)) if output_lengths == "geometric" else \
            rng.integers(4, max(5, context // 4 + 1))
        outputs.append(int(min(room, drawn)))
    arrivals = np.cumsum(rng.exponential(1 / rate, size=n)).tolist() if rate > 0 else [0.0] * n
    return Workload(arrivals, prompts, outputs)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")
