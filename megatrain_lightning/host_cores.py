"""The host cores a run may use now: the threads its host worker (gradient adds, AdamW) should start.

torch's default is one intra-op thread per core this process may run on. The host worker's thread pool and
the main thread's run side by side; while the cores are idle that is what is fastest, but when another
process keeps some of them busy, two pools that each want every core make each other wait at every
parallel region (OpenMP teams whose threads are descheduled). Measured on the 2-core CPU machine, a clipped
200-step run of ``python train.py`` (the host step after the backward):

| cores | host_threads | tokens/s |
| --- | --- | --- |
| idle | torch's default (2) | 20,885; 11,072; 10,759 (three runs) |
| idle | 1 | 11,314; 10,852 |
| one kept busy by another process | torch's default (2) | 1,471 |
| one kept busy by another process | 1 | 11,855 |
| idle | this default (2 chosen) | 10,908; 10,801 |
| one kept busy by another process | this default (1 chosen) | 11,894; 11,529 |

So the default gives the worker the cores that no other process keeps busy when the run starts (at least
one): torch's count on an idle machine, fewer on a busy one. Lightning-free.
"""

from __future__ import annotations

import os
import statistics
import time

import torch


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (``cpu.max``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _own_running() -> int:
    """This process's threads that are running or runnable now (an OpenMP team still spinning after a
    parallel region counts: it is not another process's load)."""
    running = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                running += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            pass
    return max(running, 1)  # the reading thread itself


def busy_elsewhere(samples: int = 3, interval_s: float = 0.005) -> int:
    """How many threads of other processes are running now: the median over ``samples`` readings of the
    kernel's count of runnable threads (``procs_running``, /proc/stat) less this process's own. 0 where
    /proc cannot be read."""
    counts = []
    for k in range(samples):
        try:
            with open("/proc/stat") as f:
                line = next(x for x in f if x.startswith("procs_running"))
            counts.append(int(line.split()[1]) - _own_running())
        except (OSError, StopIteration, ValueError):
            return 0
        if k + 1 < samples:
            time.sleep(interval_s)
    return max(0, int(statistics.median(counts)))


def worker_threads(busy: int | None = None) -> int:
    """The host worker's default thread count (``EngineConfig.host_threads=None``): torch's intra-op count,
    less the cores that other processes keep busy now (``busy``; measured when None), at least 1."""
    busy = busy_elsewhere() if busy is None else busy
    return max(1, min(torch.get_num_threads(), usable_cores() - busy))
