"""The kind of cache the model hands attention to: the serving engine's paged KV cache (serve/kv_cache.py) runs a
flat batch of several sequences' new tokens, stores their keys and values in its blocks and attends each to its
own sequence. The model takes the paged path by this type, not by probing the cache for methods."""

from __future__ import annotations

import abc

import torch


class PagedCache(abc.ABC):
    # the step's flat batch, set by the cache's own begin: each new token's position (N,), and which rows of the
    # batch get logits (an index, or every row)
    positions: torch.Tensor
    logit_rows: torch.Tensor | slice

    @abc.abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D), k and v (1, H_kv, N, D) of the step's new tokens, rotated: store k and v, return the
        attention output (1, H, N, D)."""
