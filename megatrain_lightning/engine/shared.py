"""Host memory shared by the ranks of one node: one host store per node, not one per rank.

Under data parallel every rank of a node maps the same buffers for the masters, frozen weights, Adam
moments and step counts (``engine/store.py``), so a 7B model needs about one 7B worth of host state per
node whatever the number of GPUs. A buffer is a file in a tmpfs (``/dev/shm``, or ``$MEGATRAIN_SHM_DIR``)
mapped with ``torch.from_file(shared=True)``, named by the job, the node and the buffer, so that every
rank of the node finds the same one; the files are unlinked once all ranks mapped them (:meth:`seal`), so
nothing is left behind when a run dies, and the memory goes when the last rank unmaps it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..errors import ConfigError


def tmpfs_dir() -> Path:
    """Where the node's shared buffers live: ``$MEGATRAIN_SHM_DIR``, else ``/dev/shm``."""
    return Path(os.environ.get("MEGATRAIN_SHM_DIR") or "/dev/shm")


def tmpfs_room() -> tuple[str, float]:
    """That directory (the nearest existing parent) and its free bytes, for the setup-time check."""
    path = tmpfs_dir()
    while not path.exists() and path != path.parent:
        path = path.parent
    return str(tmpfs_dir()), float(shutil.disk_usage(path).free)


class SharedArena:
    """Named, zero-filled host buffers that every rank of a node maps in common."""

    def __init__(self, job: str, node: int, creator: bool) -> None:
        self.dir = tmpfs_dir() / f"megatrain-{job}-node{node}"
        self.creator = creator  # the node's local rank 0: makes the directory, removes it at seal()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._names: list[Path] = []
        # the files are sparse: tmpfs counts their pages only once written, so what this rank has created
        # is added up against the room there was at the start (a full tmpfs SIGBUSes a write)
        self._room = shutil.disk_usage(self.dir).free
        self._created = 0

    def tensor(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The node's buffer ``name``: created (zeros) by the first rank to ask, mapped by the others."""
        self.dir.mkdir(parents=True, exist_ok=True)  # again after a seal: a store laid out anew
        path = self.dir / name
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if not path.exists():
            self._created += nbytes
            if self._created > self._room:
                raise ConfigError(
                    f"MegaTrainStrategy (data parallel): the node's host store needs {self._created / 1e9:.1f} GB in "
                    f"{self.dir.parent}, which had {self._room / 1e9:.1f} GB free: give the container a larger "
                    "/dev/shm (docker run --shm-size=...), or point $MEGATRAIN_SHM_DIR at a larger tmpfs"
                )
        self._names.append(path)
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)

    def seal(self) -> None:
        """Every rank has mapped what it needs (after a node barrier): the names go, the memory stays."""
        if self.creator:
            shutil.rmtree(self.dir, ignore_errors=True)
