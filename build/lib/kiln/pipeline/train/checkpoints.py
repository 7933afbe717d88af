"""Resume state for long runs: `step_NNNNNNNN/` folders, written atomically, the newest K kept.

A folder holds `model.safetensors`, `optimizer.safetensors` (every tensor of the optimizer and GradScaler
state, plus the torch RNG states) and `state.json` (step, data-loader state, python/numpy RNG, the run's
fingerprint). No pickle anywhere: a checkpoint cannot run code when loaded.

An FSDP run writes the model and optimizer tensors with `torch.distributed.checkpoint` instead: every rank
saves its own shards into `dcp/` (safetensors files whose metadata records each shard's offsets, so still no
pickle), and a run with any number of processes, FSDP or not, reads back the pieces it needs. Rank 0 writes
the rest (`rng.safetensors`, `state.json`) and renames the folder into place once every rank is done.

The fingerprint is everything that shapes the trajectory (model config, tokenizer, the optimisation params).
Only a checkpoint with the same fingerprint is resumed; others belong to a different run and are removed
when this run writes its first checkpoint, so a folder never mixes two runs.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.model.atomic import fsync_tree, replace_dir
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import atomic_dir, exclusive, recover, write_json
from kiln.pipeline.train import distributed
from kiln.pipeline.train.distributed import SINGLE, World

NAME = re.compile(r"step_\d{8}")
SHARDED = "dcp"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


class Checkpoints:
    def __init__(self, root: Path, fingerprint: dict, keep: int, world: World = SINGLE):
        self.root, self.fingerprint, self.keep, self.world = Path(root), fingerprint, keep, world

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
        """Called by every rank of a run; `model` as the loop trains it (DDP- or FSDP-wrapped under torchrun)."""
        final = step_dir(self.root, step)
        if distributed.is_sharded(model):
            return self._save_sharded(final, step, model, optimizer, scaler, loader_state, extra)
        if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO-1: gather every rank's share on rank 0
            optimizer.consolidate_state_dict(to=0)
        if self.world.main:
            self._remove_stale()
            with atomic_dir(final) as tmp:
                save_file(_model_tensors(distributed.unwrap(model)), tmp / "model.safetensors")
                opt = optimizer.state_dict()
                tensors = {f"opt.{pid}.{k}": _tensor(v) for pid, st in opt["state"].items() for k, v in st.items()}
                save_file({**tensors, **_rng_tensors()}, tmp / "optimizer.safetensors")
                self._write_state(tmp, step, opt["param_groups"], scaler, loader_state, extra)
            self._rotate()
        distributed.barrier()
        return final

    def _save_sharded(self, final: Path, step: int, model, optimizer, scaler, loader_state: dict,
                      extra: dict) -> Path:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.checkpoint import save as dcp_save

        tmp = final.with_name(f"{final.name}.tmp-{SHARDED}")  # one name all ranks agree on, without talking
        if self.world.main:
            self._remove_stale()
        distributed.barrier()
        tensors, param_groups = _sharded_state(model, optimizer)
        dcp_save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDED), save_distributed=True))
        distributed.barrier()
        if self.world.main:
            save_file(_rng_tensors(), tmp / "rng.safetensors")
            self._write_state(tmp, step, param_groups, scaler, loader_state, extra)
            fsync_tree(tmp)
            replace_dir(tmp, final)
            self._rotate()
        distributed.barrier()
        return final

    def _remove_stale(self) -> None:
        """Finish or undo the replace of a checkpoint that a kill interrupted, and drop its temp folders."""
        for name in {p.name.split(".")[0] for p in self.root.glob("step_*.*-*")}:
            recover(self.root / name)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """This run's hold on the folder (rank 0 takes it): a second run on the same checkpoints refuses; what a
        killed save left is recovered first."""
        with exclusive(self.root):
            if self.root.is_dir():
                self._remove_stale()
            yield

    def _write_state(self, folder: Path, step: int, param_groups: list, scaler, loader_state: dict,
                     extra: dict) -> None:
        np_state = np.random.get_state()
        write_json(folder / "state.json", {
            "step": step,
            "fingerprint": self.fingerprint,
            "param_groups": param_groups,
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "loader": loader_state,
            "rng_python": _jsonable(random.getstate()),
            "rng_numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            **extra,
        })

    def _rotate(self) -> None:
        mine = [p for p in self._all() if self._state(p).get("fingerprint") == self.fingerprint]
        others = [p for p in self._all() if p not in mine]
        for path in others + mine[:-self.keep]:
            shutil.rmtree(path)

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> dict:
        """Restore everything saved at `path` into the live objects; return state.json."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            return self._load(path, model, optimizer, scaler)
        except (OSError, SafetensorError, KeyError, ValueError, TypeError, CheckpointException) as e:
            raise UserError(f"{path}: corrupt checkpoint ({type(e).__name__}: {e}); delete it to go on") from None

    def _load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler) -> dict:
        state = self._state(path)
        if (path / SHARDED).is_dir():
            _load_sharded(path / SHARDED, model, optimizer)
            _set_rng(load_file(path / "rng.safetensors"), state)
        else:
            self._load_full(path, distributed.unwrap(model), optimizer, state)
        if state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
        return state

    def _load_full(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if distributed.is_sharded(model):
            raise UserError(f"{path}: written by a single-process or DDP run, which an FSDP run cannot resume; "
                            "resume it with train.parallel=ddp")
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
        _set_rng(tensors, state)


def _rng_tensors() -> dict[str, torch.Tensor]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.stack(torch.cuda.get_rng_state_all()).cpu()
    return tensors


def _set_rng(tensors: dict[str, torch.Tensor], state: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["rng.cuda"]))
    random.setstate(_tupled(state["rng_python"]))
    kind, keys, *rest = state["rng_numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """({"model": ..., "optim": ...} tensors keyed by parameter name, as DCP saves and loads them; the optimizer's
    param groups). The tied head is left out: it is the embedding, and safetensors refuses aliases."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, optimizer)
    seen, unaliased = set(), {}
    for name, tensor in weights.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.untyped_storage().data_ptr() not in seen:
            seen.add(local.untyped_storage().data_ptr())
            unaliased[name] = tensor
    return {"model": unaliased, "optim": optim["state"]}, optim["param_groups"]


def _load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Fill the live model and optimizer (plain, DDP or FSDP, any world size) from a sharded checkpoint."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if hasattr(optimizer, "consolidate_state_dict"):
        raise UserError(f"{folder.parent}: an FSDP checkpoint; resume it with train.zero1=false")
    tensors, param_groups = _sharded_state(model, optimizer)
    dcp_load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)))
    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optim"], "param_groups": param_groups},
                   options=StateDictOptions(strict=False))


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
