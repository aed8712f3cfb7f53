"""The ranks that train one model together (data parallel over ``torch.distributed``).

Every rank computes every block on its own micro-batch. A block's gradients are averaged over all ranks
on the device (``all_reduce``) before they leave it; then only the block's **owner** on each node copies
them home and runs the block's host update, into the node's one host store (``shared.py``), which every
rank of the node reads. Blocks (and the resident parts) are owned round robin by the node's ranks, so the
host AdamW of a step is split between them. Across nodes, each node's owner updates its node's copy
identically (the gradients being the same after the global reduction).

Visibility: each store carries a counter in shared memory (``FlatStore.published``), raised by its owner
when the store's update of a step is done; a rank copies a store it does not own to the device only once
the counter has reached the number of steps taken (``wait_published``). One rank alone is the trivial case:
it owns everything and nothing is reduced.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .shared import SharedArena


@dataclass
class Replicas:
    """Where this rank sits, and the collectives it takes part in."""

    world: int = 1
    rank: int = 0
    local_size: int = 1
    local_rank: int = 0
    node: int = 0
    arena: SharedArena | None = None
    group: Any = None  # the whole job's process group (None: the default one)
    node_group: Any = None  # the ranks of this node (norms of a partitioned host state)
    leaders: Any = None  # each node's local rank 0 (consistent weights across nodes)
    steps: int = field(default=0)  # optimizer steps taken: what every store's counter must reach
    peers: dict[int, int] = field(default_factory=dict)  # local rank -> pid of the node's other ranks

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def owner(self, index: int) -> int:
        """The local rank that updates store ``index`` (blocks first, then the resident parts)."""
        return index % self.local_size

    def owns(self, index: int) -> bool:
        return self.owner(index) == self.local_rank

    # ------------------------------------------------------------------ collectives
    def average(self, flat: torch.Tensor) -> None:
        """Average ``flat`` over every rank, in place (host sync on gloo; on NCCL ordered by the caller's
        stream)."""
        import torch.distributed as dist

        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)

    def node_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over the ranks of this node (each holds a part of the node's host state)."""
        import torch.distributed as dist

        if self.local_size > 1:
            dist.all_reduce(value, group=self.node_group)
        return value

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on every rank (a host sync)."""
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def node_barrier(self) -> None:
        import torch.distributed as dist

        if self.local_size > 1:
            dist.barrier(group=self.node_group)

    def from_global_zero(self, tensors: list[torch.Tensor]) -> None:
        """Make every node's copy of ``tensors`` global rank 0's (node leaders only; a no-op on one node)."""
        import torch.distributed as dist

        if self.world == self.local_size or self.local_rank != 0:
            return
        for t in tensors:
            if t.numel():
                dist.broadcast(t, src=0, group=self.leaders)

    def wait_published(self, counter: torch.Tensor, target: int, timeout: float = 3600.0) -> None:
        """Host wait until a store's shared counter reaches ``target`` (its owner's update has run). A rank
        of the node that exited meanwhile (an exception between its backward and its step, which no collective
        of this rank's would notice) ends the wait with an error instead of the timeout."""
        start = last_look = time.perf_counter()
        delay = 1e-5
        while int(counter[0]) < target:
            now = time.perf_counter()
            if now - start > timeout:
                raise TimeoutError(f"a store's update of step {target} did not arrive in {timeout:.0f} s (its owner died?)")
            if now - last_look > 1.0:
                last_look = now
                gone = [f"local rank {r} (pid {pid})" for r, pid in self.peers.items() if not process_alive(pid)]
                if gone:
                    raise RuntimeError(
                        f"MegaTrainStrategy: {', '.join(gone)} of this node exited while this rank waited for a "
                        f"store's update of step {target}, which the node's ranks share: stopping this rank too "
                        "(the first rank's own error is in its output).")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether a signal could reach it
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def groups(world: int, local_size: int) -> tuple[Any, Any, Any]:
    """(global, this node's, node leaders') process groups; every rank must call this, in the same order.
    Ranks are node-major: node n holds ranks n * local_size ... (n + 1) * local_size - 1."""
    import torch.distributed as dist

    rank = dist.get_rank()
    nodes = world // local_size
    node_group = None
    for n in range(nodes):  # new_group is collective: every rank creates every group
        g = dist.new_group(list(range(n * local_size, (n + 1) * local_size)))
        if rank // local_size == n:
            node_group = g
    leaders = dist.new_group([n * local_size for n in range(nodes)])
    return None, node_group, leaders
