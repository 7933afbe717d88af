"""One copy to the device per step: a step's small arrays packed into one persistent buffer.

On a GPU a small tensor per index array costs more than the model's arithmetic (each is a host-to-device copy
and a launch), so every array a step needs goes into one int64 host buffer (pinned on CUDA) and crosses in one
copy to a device buffer that lives as long as the engine; the arrays come back as views of it. float32 arrays
travel as their bits, two to an int64. Both buffers grow (doubling) when a step needs more, and are never freed
between steps. On a CPU there is nothing to copy: each array is its tensor.
"""

from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    def __init__(self, device: torch.device, capacity: int = 4096, pack: bool | None = None):
        self.device = torch.device(device)
        # packed into the buffers: off a CPU (where each array is its own tensor), unless told (tests check the
        # packing on a CPU)
        self.pack = self.device.type != "cpu" if pack is None else pack
        self.capacity = 0
        self.copied: torch.cuda.Event | None = None  # the last copy, which the next one's host writes must follow
        self.uploads = 0  # over the buffer's life, for `kiln bench serve`
        if self.pack:
            self._grow(capacity)

    def _grow(self, size: int) -> None:
        self.capacity = max(size, 2 * self.capacity)
        self.host = torch.empty(self.capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.host_view = self.host.numpy()
        self.buffer = torch.empty(self.capacity, dtype=torch.int64, device=self.device)

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each array as a tensor of its shape on the device, all from one copy: integers as int64, float32 as
        float32. On a CPU the tensors share the arrays' memory: the caller must not write them afterwards."""
        self.uploads += 1
        if not self.pack:
            # the host is the device: each array is its own tensor, sharing its memory (no packing, no copy: a few
            # microseconds a step matter at batch 1, and packing GRPO's dozen arrays cost 0.1-0.2 ms a step)
            return {name: torch.from_numpy(_as_cpu(a)) for name, a in arrays.items()}
        flat = [_as_int64(a) for a in arrays.values()]
        sizes = [f.size for f in flat]
        packed = np.concatenate(flat) if flat else np.zeros(0, np.int64)
        if self.copied is not None:
            self.copied.synchronize()  # the copy still in flight reads the host buffer about to be rewritten
        if packed.size > self.capacity:
            self._grow(packed.size)
        self.host_view[:packed.size] = packed
        on_device = self.buffer[:packed.size]
        on_device.copy_(self.host[:packed.size], non_blocking=True)
        if self.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record()
        out = {}
        for (name, a), piece in zip(arrays.items(), on_device.split(sizes)):
            if a.dtype == np.float32:
                piece = piece.view(torch.float32)[:a.size]
            out[name] = piece if a.ndim == 1 else piece.view(a.shape)
        return out


def _as_cpu(a: np.ndarray) -> np.ndarray:
    """`a` as the dtype its tensor has on the device: integers int64, float32 as it is."""
    if a.dtype == np.float32:
        return np.ascontiguousarray(a)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{a.dtype}: expected integers or float32")
    return np.ascontiguousarray(a, dtype=np.int64)


def _as_int64(a: np.ndarray) -> np.ndarray:
    """`a` flat in int64 words: float32 as its bits, two to a word."""
    flat = _as_cpu(a).reshape(-1)
    if flat.dtype == np.float32:
        return np.concatenate([flat, np.zeros(flat.size % 2, np.float32)]).view(np.int64)
    return flat
