"""Resume state for long runs: `step_NNNNNNNN/` folders, written atomically, the newest K kept.

A folder holds `model.safetensors`, `optimizer.safetensors` (every tensor of the optimizer and GradScaler
state, plus the torch RNG states) and `state.json` (step, data-loader state, python/numpy RNG, the run's
fingerprint). No pickle anywhere: a checkpoint cannot run code when loaded.

The fingerprint is everything that shapes the trajectory (model config, tokenizer, the optimisation params).
Only a checkpoint with the same fingerprint is resumed; others belong to a different run and are removed
when this run writes its first checkpoint, so a folder never mixes two runs.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pipeline.errors import UserError
from pipeline.files import atomic_dir, write_json

NAME = re.compile(r"step_\d{8}")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


class Checkpoints:
    def __init__(self, root: Path, fingerprint: dict, keep: int):
        self.root, self.fingerprint, self.keep = Path(root), fingerprint, keep

    def _all(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and NAME.fullmatch(p.name))

    def _state(self, path: Path) -> dict:
        try:
            return json.loads((path / "state.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{path / 'state.json'}: corrupt checkpoint ({e}); delete {path} to go on") from None

    def latest(self) -> Path | None:
        """The newest checkpoint of this run, or None to start from scratch."""
        for path in reversed(self._all()):
            if self._state(path).get("fingerprint") == self.fingerprint:
                return path
        return None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler, loader_state: dict,
             extra: dict) -> Path:
        final = step_dir(self.root, step)
        for stale in self.root.glob("step_*.*-*"):  # temp folders of a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        with atomic_dir(final) as tmp:
            save_file(_model_tensors(model), tmp / "model.safetensors")
            opt = optimizer.state_dict()
            tensors = {f"opt.{pid}.{k}": _tensor(v) for pid, st in opt["state"].items() for k, v in st.items()}
            tensors["rng.torch"] = torch.get_rng_state()
            if torch.cuda.is_available():
                tensors["rng.cuda"] = torch.stack(torch.cuda.get_rng_state_all())
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
            np_state = np.random.get_state()
            write_json(tmp / "state.json", {
                "step": step,
                "fingerprint": self.fingerprint,
                "param_groups": opt["param_groups"],
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "loader": loader_state,
                "rng_python": _jsonable(random.getstate()),
                "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
                **extra,
            })
        mine = [p for p in self._all() if self._state(p).get("fingerprint") == self.fingerprint]
        others = [p for p in self._all() if p not in mine]
        for path in others + mine[:-self.keep]:
            shutil.rmtree(path)
        return final

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> dict:
        """Restore everything saved at `path` into the live objects; return state.json."""
        try:
            return self._load(path, model, optimizer, scaler)
        except (OSError, SafetensorError, KeyError, ValueError, TypeError) as e:
            raise UserError(f"{path}: corrupt checkpoint ({type(e).__name__}: {e}); delete it to go on") from None

    def _load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> dict:
        state = self._state(path)
        weights = load_file(path / "model.safetensors")
        tensors = load_file(path / "optimizer.safetensors")
        missing = set(_model_tensors(model)) ^ set(weights)
        if missing:
            raise UserError(f"{path / 'model.safetensors'}: tensors do not match the model ({sorted(missing)[:3]})")
        # Tied weights are one Parameter stored under its first name, so loading it fills both uses.
        model.load_state_dict(weights, strict=False)
        opt_state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("opt."):
                _, pid, name = key.split(".", 2)
                opt_state.setdefault(int(pid), {})[name] = value
        optimizer.load_state_dict({"state": opt_state, "param_groups": state["param_groups"]})
        if state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(tensors["rng.torch"])
        if "rng.cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(tensors["rng.cuda"]))
        random.setstate(_tupled(state["rng_python"]))
        kind, keys, *rest = state["rng_numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
        return state


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with shared (tied) tensors stored once: safetensors refuses aliases."""
    seen, out = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.detach().contiguous().cpu()
    return out


def _tensor(v) -> torch.Tensor:
    return v if isinstance(v, torch.Tensor) else torch.tensor(v)


def _jsonable(obj):
    return [_jsonable(x) for x in obj] if isinstance(obj, tuple) else obj


def _tupled(obj):
    return tuple(_tupled(x) for x in obj) if isinstance(obj, list) else obj
