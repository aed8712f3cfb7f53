"""Data parallel plumbing for MegaTrainStrategy: the process group, this rank's ``Replicas``, the
collectives Lightning asks a strategy for, and gradient-norm clipping over a node-partitioned host state.

Launch as Lightning users do: ``Trainer(strategy="megatrain", devices=N, num_nodes=M)`` (Lightning's own
launcher starts the ranks) or under ``torchrun``. NCCL on GPUs, gloo on the CPU. The engine side is
``engine/replicas.py`` and ``engine/shared.py``.
"""

from __future__ import annotations

import atexit
import os
import uuid
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _init_dist_connection

from .engine.replicas import Replicas, groups, process_alive
from .engine.shared import SharedArena


def init_process_group(cluster_environment: Any, device: torch.device, timeout: timedelta) -> None:
    """The job's default process group: NCCL on CUDA, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device
    import torch.distributed as dist

    created = not dist.is_initialized()
    _init_dist_connection(cluster_environment, backend, **kwargs)
    if created:
        # a process group left to the interpreter's finalization can abort the exit: gloo's worker threads
        # still hold work whose tensors then take a GIL that is going away ("terminate called without an
        # active exception", SIGABRT after a finished fit). Destroyed while Python is still whole instead;
        # a no-op where the user destroyed it already.
        atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def make_replicas(world: int, rank: int, local_size: int, local_rank: int, node: int) -> Replicas:
    """This rank's place, its groups, and the node's shared arena (named by a token global rank 0 draws)."""
    import torch.distributed as dist

    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    group, node_group, leaders = groups(world, local_size)
    arena = SharedArena(str(token[0]), node, creator=local_rank == 0)
    where: list[Any] = [None] * world  # (node, local rank, pid) of every rank: a wait on a peer sees it exit
    dist.all_gather_object(where, (node, local_rank, os.getpid()))  # also: the arena's directory exists now
    # a peer whose pid this process cannot see (another pid namespace) is not watched: it would look exited
    peers = {r: pid for n, r, pid in where if n == node and r != local_rank and process_alive(pid)}
    return Replicas(world=world, rank=rank, local_size=local_size, local_rank=local_rank, node=node, arena=arena,
                    group=group, node_group=node_group, leaders=leaders, peers=peers)


def first_refusal(message: str | None, world: int) -> str | None:
    """Every rank's verdict of a setup check (None: fits), gathered: the first refusal is every rank's, so
    that no rank goes on to wait for one that raised."""
    import torch.distributed as dist

    verdicts: list[str | None] = [None] * world
    dist.all_gather_object(verdicts, message)
    return next((v for v in verdicts if v), None)


def clip_grad_norm(engine: Any, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a host state partitioned among a node's ranks: each rank
    holds the gradients of the stores it owns; their squared norms are summed over the node (every node
    holds the same reduced gradients), and each rank scales its own. Returns the total norm."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    total = engine.replicas.node_sum(local.reshape(1)).sqrt()[0]
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(scale.to(g.dtype))
    return total
