"""How much host memory this process may really use: MemTotal/MemAvailable, capped by its cgroup's limit
and by its address-space limit (``ulimit -v``).

A container's limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``) is what the out-of-memory
killer enforces, whatever ``/proc/meminfo`` says about the machine; ``ulimit -v`` makes allocations past it
fail. Lightning-free; read afresh on each call.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if len(line.split()) >= 2}
    except (OSError, ValueError):
        return {}


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_dir() -> Path | None:
    """This process's cgroup directory (v2 unified hierarchy, else the v1 memory controller's)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hier == "0" and controllers == "":  # v2
            return _CGROUP_ROOT / path.lstrip("/")
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return _CGROUP_ROOT / "memory" / path.lstrip("/")
    return None


def cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup, or None where there is no limit."""
    d = _cgroup_dir()
    if d is None:
        return None
    for limit_file, usage_file in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        limit = _read_int(d / limit_file)
        if limit is not None and limit < 1 << 60:  # v1 reports "no limit" as a huge number
            return limit, _read_int(d / usage_file) or 0
    return None


def total_bytes() -> int:
    """Host memory this process can ever hold: MemTotal, or its cgroup's limit if lower."""
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cg = cgroup_limit()
    return min(total, cg[0]) if cg else total


def meminfo_available() -> int:
    """MemAvailable of /proc/meminfo (the whole machine's view)."""
    return _meminfo().get("MemAvailable", total_bytes())


def address_space_headroom() -> int | None:
    """Bytes of address space left under ``ulimit -v`` (RLIMIT_AS), or None where there is no such limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        size = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return max(0, soft - size)


def available_bytes() -> int:
    """Host memory this process can still allocate now: MemAvailable, or its cgroup's or its address-space
    limit's headroom if lower."""
    info = _meminfo()
    available = info.get("MemAvailable", total_bytes())
    cg = cgroup_limit()
    if cg:
        available = min(available, max(0, cg[0] - cg[1]))
    vm = address_space_headroom()
    return available if vm is None else min(available, vm)
