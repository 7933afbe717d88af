"""One copy to the device per step: a step's small arrays packed into one persistent buffer.

On a GPU a small tensor per index array costs more than the model's arithmetic (each is a host-to-device copy
and a launch), so every array a step needs goes into one int64 host buffer (pinned on CUDA) and crosses in one
copy to a device buffer that lives as long as the engine; the arrays come back as views of it. float32 arrays
travel as their bits, two to an int64. Both buffers grow (doubling) when a step needs more, and are never freed
between steps.
"""

from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    def __init__(self, device: torch.device, capacity: int = 4096):
        self.device = torch.device(device)
        self.capacity = 0
        self.copied: torch.cuda.Event | None = None  # the last copy, which the next one's host writes must follow
        self._grow(capacity)

    def _grow(self, size: int) -> None:
        self.capacity = max(size, 2 * self.capacity)
        cuda = self.device.type == "cuda"
        self.host = torch.empty(self.capacity, dtype=torch.int64, pin_memory=cuda)
        self.host_view = self.host.numpy()
        # On the CPU the host buffer is the device buffer: nothing to copy.
        self.buffer = torch.empty(self.capacity, dtype=torch.int64, device=self.device) if cuda or \
            self.device.type != "cpu" else self.host

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each array (int64, int32 or float32) as a tensor of its shape and dtype on the device, all from one copy."""
        packed = {name: _as_int64(a) for name, a in arrays.items()}
        size = sum(p.size for p in packed.values())
        if self.copied is not None:
            self.copied.synchronize()  # the copy still in flight reads the host buffer about to be rewritten
        if size > self.capacity:
            self._grow(size)
        offsets, at = {}, 0
        for name, p in packed.items():
            self.host_view[at:at + p.size] = p
            offsets[name] = (at, p.size)
            at += p.size
        if self.buffer is not self.host:
            self.buffer[:at].copy_(self.host[:at], non_blocking=True)
            if self.device.type == "cuda":
                self.copied = torch.cuda.Event()
                self.copied.record()
        out = {}
        for name, a in arrays.items():
            start, n = offsets[name]
            view = self.buffer[start:start + n]
            if a.dtype == np.float32:
                view = view.view(torch.float32)[:a.size]
            elif a.dtype == np.int32:
                view = view.to(torch.int32)
            out[name] = view.view(a.shape)
        return out


def _as_int64(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float32:
        flat = np.ascontiguousarray(a).reshape(-1)
        return np.concatenate([flat, np.zeros(flat.size % 2, np.float32)]).view(np.int64)
    if a.dtype not in (np.int64, np.int32):
        raise TypeError(f"{a.dtype}: expected int64, int32 or float32")
    return a.astype(np.int64, copy=False).reshape(-1)
