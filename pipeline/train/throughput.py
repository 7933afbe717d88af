"""Peak FLOP/s for MFU, by device name, each figure with its source.

GPU figures are dense (no 2:4 sparsity) tensor-core peaks from the vendor's datasheets: bf16/fp16 for mixed
precision, TF32 for fp32 (kiln enables TF32 matmuls in fp32 on CUDA). A CPU has no datasheet figure we can
look up portably, so its "peak" is measured: the best of a few large fp32 matmuls on this machine. MFU on a
CPU therefore says how close training gets to the machine's own GEMM speed.
"""

from __future__ import annotations

import time

import torch

# name fragment (as in torch.cuda.get_device_name) -> (bf16/fp16 FLOP/s, tf32 FLOP/s, source)
GPU_PEAKS = {
    "H200": (989e12, 494.5e12, "NVIDIA H200 datasheet (SXM, dense)"),
    "H100 PCIe": (756e12, 378e12, "NVIDIA H100 datasheet (PCIe, dense)"),
    "H100": (989e12, 494.5e12, "NVIDIA H100 datasheet (SXM, dense)"),
    "A100": (312e12, 156e12, "NVIDIA A100 datasheet (dense)"),
    "L40S": (362e12, 183e12, "NVIDIA L40S datasheet (dense)"),
    "RTX 4090": (165e12, 82.6e12, "NVIDIA Ada whitepaper, GeForce RTX 4090 (dense, fp32 accumulate)"),
}


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (half, tf32, source) in GPU_PEAKS.items():
            if fragment in name:
                # fp8 against the bf16 peak, as torchtitan reports it: its MFU stays comparable with bf16's
                return (half if precision in ("bf16", "fp16", "fp8") else tf32), source
        return None, f"no peak figure for {name}"
    if device.type == "cpu":
        return measured_cpu_peak(), "measured: best fp32 matmul 1024x1024 on this CPU"
    return None, f"no peak figure for {device.type}"


_cpu_best = 0.0


def measured_cpu_peak(n: int = 1024, repeats: int = 5) -> float:
    """The best fp32 matmul FLOP/s seen so far in this process. Other work on the machine can only slow a
    measurement down, so the best of several (the loop measures at the start and again at the end of a run)
    is the closest to what the CPU can do; one taken while the machine was busy would inflate MFU."""
    global _cpu_best
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        _cpu_best = max(_cpu_best, 2 * n**3 / (time.perf_counter() - start))
    return _cpu_best
