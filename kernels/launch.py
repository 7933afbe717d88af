"""How kiln's kernels are launched: block sizes and warps derived in one place, and the candidates a GPU tunes.

Two kinds of launch settings:
- Derived from a size (`calculate_settings`, as Liger-Kernel's helper of that name): a kernel that holds a whole
  row in registers needs a block of the row's next power of two, and more warps as that block grows so that
  each thread keeps a few 16-byte vectors rather than spilling.
- Tuned (`autotune`): a few candidate `triton.Config`s per kernel, keyed on the sizes that change the answer;
  on a GPU Triton times each candidate on the first call with a new key and keeps the fastest for the
  process. `picked()` reports each choice so a benchmark can save what it ran.

In Triton's interpreter (CPU, TRITON_INTERPRET=1) there is nothing to tune: the interpreter's time is Python's
and every candidate would run the kernel again. There each kernel runs one config, its `interpreter` config if
it names one (small tiles, so small test inputs still span several blocks) or else its first.
"""

from __future__ import annotations

import functools

import torch
import triton

from kiln.kernels.backend import interpreting

# Elements one program may hold along a row (a register file's worth at 4 bytes each before spilling badly).
MAX_FUSED_SIZE = 65536

# Block sizes and warps for an element-wise kernel over a flat array: blocks large enough that each thread moves
# several 16-byte vectors, so launch and index overhead vanish against the memory traffic. The first (4096 over
# 8 warps) was the hand-picked setting before any tuning.
ELEMENTWISE_CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((4096, 8), (1024, 4), (2048, 4),
                                                                              (8192, 8), (8192, 16))]

_TUNED: list = []  # every autotuned kernel, for picked()


def calculate_settings(n: int, name: str = "row") -> tuple[int, int]:
    """(block, num_warps) for a program holding n elements: block = n's next power of two, warps growing with
    it (4 up to 2k elements, then 8, 16, and 32 from 32k: 8-16 elements a thread)."""
    block = triton.next_power_of_2(n)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"{name}: {n} elements > {MAX_FUSED_SIZE}, more than one program holds in registers")
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def near_derived_warps(size_arg: str):
    """An autotune pruner for row kernels: only the candidates within a factor of two of calculate_settings'
    warps for the width in argument `size_arg`, a search around the derivation rather than over every count."""
    def prune(configs, named_args, **kwargs):
        warps = calculate_settings(named_args[size_arg])[1]
        return [c for c in configs if warps // 2 <= c.num_warps <= 2 * warps] or configs
    return prune


def autotune(configs: list[triton.Config], key: list[str], interpreter: triton.Config | None = None, **kwargs):
    """triton.autotune over `configs` keyed on the `key` arguments (and every tensor argument's dtype); in the
    interpreter only `interpreter` (default: the first config). kwargs go to triton.autotune (restore_value
    for a kernel that writes over an input, prune_configs_by)."""
    def decorate(fn):
        if interpreting():
            tuned = triton.autotune([interpreter or configs[0]], key=key)(fn)
        else:
            tuned = triton.autotune(configs, key=key, **kwargs)(fn)
        _TUNED.append(tuned)
        return tuned
    return decorate


def _describe(config: triton.Config) -> dict:
    return {name: value for name, value in config.all_kwargs().items() if value is not None}


def picked() -> dict[str, list[dict]]:
    """What each autotuned kernel ran in this process: per key seen, the sizes and dtypes it was keyed on and the
    config chosen (a kernel with a single candidate reports that one, once it has run)."""
    report = {}
    for tuned in _TUNED:
        name = tuned.base_fn.__name__
        if tuned.cache:
            report[name] = [{"key": [str(k) for k in key], "config": _describe(config)}
                            for key, config in tuned.cache.items()]
        elif getattr(tuned, "best_config", None) is not None:
            report[name] = [{"key": None, "config": _describe(tuned.best_config)}]
    return report


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device: the query costs a driver call)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
