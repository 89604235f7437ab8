"""Sharded checkpoints: a safetensors file per rank and an index, loadable at any N.

::

    swarmfd.torch.checkpoint.save("ckpt/step-1000", model, optimizer)   # every rank
    swarmfd.torch.checkpoint.load("ckpt/step-1000", model, optimizer)   # any world size

``save`` creates the folder (one every rank sees: a shared volume on a Swarm); every
rank writes ``rank-RRRRR-of-NNNNN.safetensors`` with what it holds (a unit's part of
the parameters and of the optimizer state under :func:`~swarmfd.torch.fully_shard`,
its owned part of each bucket under
:class:`~swarmfd.torch.ZeroRedundancyOptimizer`, 1/N of every other tensor), then rank
0 writes ``index.json``: for every tensor of the model's ``state_dict`` and of the
optimizer's state, its shape, dtype and which rank's file holds which elements, and
the optimizer's class and hyperparameters. A folder without ``index.json`` is no
checkpoint (the index goes last, and first away when a save overwrites).

``load`` reads on every rank only the elements that rank holds, from whichever files
have them: the checkpoint may come from another world size and another wrapper (saved
sharded, loaded into a plain module at N=1; saved from DDP and ZeRO, loaded sharded).
It fills a freshly built optimizer (one that has not stepped), so training continues
exactly. ``path`` may also be one ``.safetensors`` file of a model's state dict
(``safetensors.torch.save_file(model.state_dict(), path)``): the model alone.

Nothing is unpickled: tensors come from safetensors files, the rest from JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import swarmfd as fd

from . import _layout
from .state_dict import Source, load_model, load_optimizer

INDEX = "index.json"
FORMAT = "swarmfd.torch.checkpoint"
VERSION = 1
_FILE = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool)}


def _file_name(rank: int, size: int) -> str:
    return f"rank-{rank:05d}-of-{size:05d}.safetensors"


def _even(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s elements of ``n`` cut evenly over ``size`` ranks."""
    part = -(-n // size)
    return min(n, rank * part), min(n, (rank + 1) * part)


def _pieces(layout: _layout.Layout, rank: int, size: int
            ) -> tuple[dict[str, torch.Tensor], dict[str, list[list[Any]]]]:
    """What this rank writes: stored tensors (1-D, contiguous, no two in one storage) and,
    per logical key, its chunks [start, stop, stored name, offset in it]."""
    stored: dict[str, torch.Tensor] = {}
    chunks: dict[str, list[list[Any]]] = {}
    for fi, flat in enumerate(layout.flats):  # (ZeRO's parameters: the owned parts)
        for pi, (start, t) in enumerate(flat.pieces):
            t = t.detach().reshape(-1)
            if not t.numel():
                continue
            name = f"flat{fi}.{pi}"
            stored[name] = t
            stop = start + t.numel()
            for item in flat.items:
                a, z = max(start, item.offset), min(stop, item.offset + item.numel)
                if a < z:
                    chunks.setdefault(item.key, []).append(
                        [a - item.offset, z - item.offset, name, a - start])
    for w in layout.wholes:
        a, z = _even(w.tensor.numel(), size, rank)
        if a < z:
            stored[w.key] = w.tensor.reshape(-1)[a:z]
            chunks[w.key] = [[a, z, w.key, 0]]
    seen: set[tuple[int, int]] = set()
    for name, t in stored.items():  # safetensors refuses tensors sharing a storage
        s = t.untyped_storage()
        if (s.data_ptr(), s.nbytes()) in seen or not t.is_contiguous():
            stored[name] = t.clone()
        else:
            seen.add((s.data_ptr(), s.nbytes()))
    return stored, chunks


def save(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write ``model``'s (and ``optimizer``'s) state to the folder ``path``, sharded:
    every rank its own file, rank 0 the index. Collective (every rank of the model's
    group); returns when the whole checkpoint is on disk."""
    layout = _layout.model_layout(model, "checkpoint.save")
    if optimizer is not None:
        _layout.optimizer_layout(layout, optimizer, "checkpoint.save")
    rank, size = _layout.world(layout)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        with contextlib.suppress(FileNotFoundError):
            (folder / INDEX).unlink()  # the old checkpoint is gone from here on
    _barrier(layout)
    stored, chunks = _pieces(layout, rank, size)
    name = _file_name(rank, size)
    tmp = folder / f".{name}.tmp"
    save_file(stored, str(tmp), metadata={"format": FORMAT})
    os.replace(tmp, folder / name)
    meta = {k: [list(layout.shapes[k]), str(layout.dtypes[k]).removeprefix("torch."), c]
            for k, c in chunks.items()}
    every = fd.all_gather_object(meta, group=layout.group) if size > 1 else [meta]
    if rank == 0:
        _write_index(folder, layout, every, size)
    _barrier(layout)


def _barrier(layout: _layout.Layout) -> None:
    if fd.get_world_size(layout.group) > 1:
        fd.barrier(group=layout.group)


def _write_index(folder: Path, layout: _layout.Layout, every: list[dict[str, Any]],
                 size: int) -> None:
    tensors: dict[str, Any] = {}
    for r, meta in enumerate(every):
        for key, (shape, dtype, chunks) in meta.items():
            entry = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "chunks": []})
            entry["chunks"] += [[r, *c] for c in chunks]
    for key in layout.shapes:  # tensors no rank holds an element of (0 elements)
        tensors.setdefault(key, {"shape": list(layout.shapes[key]), "chunks": [],
                                 "dtype": str(layout.dtypes[key]).removeprefix("torch.")})
    index: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "world_size": size,
        "files": [_file_name(r, size) for r in range(size)],
        "model": layout.keys, "aliases": layout.aliases, "tensors": tensors,
        "optimizer": None}
    info = layout.optimizer
    if info is not None:
        state: dict[str, dict[str, Any]] = {}
        for key in tensors:
            if key.startswith("optim/"):
                pname, _, skey = key[len("optim/"):].rpartition("/")
                state.setdefault(pname, {})[skey] = None
        for pname, values in info["values"].items():
            state.setdefault(pname, {}).update(values)
        index["optimizer"] = {"class": info["class"], "param_groups": info["param_groups"],
                              "params": info["params"], "state": state}
    tmp = folder / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, allow_nan=False))
    os.replace(tmp, folder / INDEX)
    for old in folder.glob("rank-*-of-*.safetensors"):  # files of an older save at another N
        if old.name not in index["files"]:
            with contextlib.suppress(OSError):
                old.unlink()


class CheckpointSource(Source):
    """A checkpoint folder (or one ``.safetensors`` file of a state dict) to load from."""

    def __init__(self, path: str | os.PathLike[str], what: str) -> None:
        self.what = what
        self.path = Path(path)
        self.single = False  # one file of a state dict: its tensors keep their shapes
        self._files = contextlib.ExitStack()
        self._open: dict[int, Any] = {}
        if self.path.is_file():
            self._single()
        else:
            self._index()

    def _single(self) -> None:
        self.files = [self.path]
        self.tensors: dict[str, dict[str, Any]] = {}
        handle = self._handle(0)
        keys = list(handle.keys())
        strip = bool(keys) and all(k.startswith("module.") for k in keys)  # torch's DDP
        for k in keys:
            shape = [int(d) for d in handle.get_slice(k).get_shape()]
            name = k[len("module."):] if strip else k
            self.tensors[f"model/{name}"] = {"shape": shape,
                                             "chunks": [[0, 0, math.prod(shape), k, 0]]}
        self.single = True

    def _index(self) -> None:
        where = self.path / INDEX
        if not where.is_file():
            raise FileNotFoundError(f"swarmfd.torch.{self.what}: {self.path} holds no "
                                    f"checkpoint ({INDEX} is missing: none was saved there, "
                                    "or a save did not finish)")
        try:
            index = json.loads(where.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"swarmfd.torch.{self.what}: {where} is not readable JSON "
                             f"({exc})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT or \
                index.get("version") != VERSION:
            raise ValueError(f"swarmfd.torch.{self.what}: {where} is not a {FORMAT} index "
                             f"of version {VERSION}")
        files = index.get("files")
        if not isinstance(files, list) or not all(isinstance(f, str) and _FILE.fullmatch(f)
                                                  for f in files):
            raise ValueError(f"swarmfd.torch.{self.what}: {where} names files that are not "
                             "rank-RRRRR-of-NNNNN.safetensors in its folder")
        self.files = [self.path / f for f in files]
        self.tensors = index["tensors"]
        for key, t in self.tensors.items():
            if t.get("dtype") not in _DTYPES or not all(
                    isinstance(c, list) and len(c) == 5 and 0 <= c[0] < len(files)
                    for c in t.get("chunks", [])):
                raise ValueError(f"swarmfd.torch.{self.what}: {where}: entry {key!r} is "
                                 "malformed")
        for alias, kept in (index.get("aliases") or {}).items():
            if kept in self.tensors:
                self.tensors.setdefault(alias, self.tensors[kept])
        self.optimizer = index.get("optimizer")

    def _handle(self, i: int) -> Any:
        h = self._open.get(i)
        if h is None:
            h = self._open[i] = self._files.enter_context(
                safe_open(str(self.files[i]), framework="pt"))
        return h

    def close(self) -> None:
        self._files.close()
        self._open.clear()

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, key: str) -> tuple[int, ...] | None:
        t = self.tensors.get(key)
        return None if t is None else tuple(int(d) for d in t["shape"])

    def read(self, key: str, start: int, stop: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        entry = self.tensors[key]
        chunks = entry["chunks"]
        if out is None and len(chunks) == 1 and chunks[0][1] <= start and \
                stop <= chunks[0][2]:
            return self._chunk(chunks[0], start, stop)  # all in one chunk: a view of it
        if out is None:
            out = torch.empty(stop - start, dtype=_DTYPES.get(entry.get("dtype", ""),
                                                              torch.float32))
        filled = 0
        for c in chunks:
            a, z = max(start, c[1]), min(stop, c[2])
            if a < z:
                out[a - start:z - start].copy_(self._chunk(c, a, z))
                filled += z - a
        if filled != stop - start:
            raise ValueError(f"swarmfd.torch.{self.what}: the checkpoint lacks elements of "
                             f"{key.split('/', 1)[1]!r} ({filled} of {stop - start} found: "
                             "a file of another save?)")
        return out

    def _chunk(self, c: list[Any], a: int, z: int) -> torch.Tensor:
        """Elements [a, z) of the logical tensor, from chunk ``c`` that holds them."""
        file, start, _, stored, offset = c
        if self.single:
            return self._handle(0).get_tensor(stored).reshape(-1)[a:z]
        sl = self._handle(int(file)).get_slice(stored)
        return sl[offset + a - start:offset + z - start]


def load(path: str | os.PathLike[str], model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> None:
    """Fill ``model`` (and ``optimizer``) on every rank from the checkpoint ``path``
    (a folder :func:`save` wrote, at any world size; or one ``.safetensors`` file of the
    model's state dict). Each rank reads only the elements it holds."""
    layout = _layout.model_layout(model, "checkpoint.load")
    if optimizer is not None:
        _layout.optimizer_layout(layout, optimizer, "checkpoint.load")
    source = CheckpointSource(path, "checkpoint.load")
    try:
        load_model(layout, source, "checkpoint.load")
        if optimizer is not None:
            if source.optimizer is None:
                raise ValueError(f"swarmfd.torch.checkpoint.load: {path} holds no optimizer "
                                 "state (saved without an optimizer)")
            load_optimizer(layout, optimizer, source, "checkpoint.load")
    finally:
        source.close()


__all__ = ["INDEX", "CheckpointSource", "load", "save"]
