"""The host worker's default thread count (``host_threads=None``, ``host_cores.py``): the cores that no
other process keeps busy, measured from the kernel's count of running threads, at least one."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from megatrain_lightning import host_cores
from megatrain_lightning.config import EngineConfig
from megatrain_lightning.engine import StreamingEngine


def test_worker_threads_leave_the_busy_cores() -> None:
    n = torch.get_num_threads()
    cores = host_cores.usable_cores()
    assert host_cores.worker_threads(busy=0) == min(n, cores)
    assert host_cores.worker_threads(busy=cores - 1) == 1
    assert host_cores.worker_threads(busy=10 * cores) == 1  # never fewer than one


def test_a_process_spinning_on_a_core_is_counted() -> None:
    before = host_cores.busy_elsewhere(samples=9)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        during = host_cores.busy_elsewhere(samples=9)
    finally:
        spin.kill()
        spin.wait()
    assert during >= before + 1 or during >= 1, (before, during)


def test_the_engine_starts_its_worker_with_the_free_cores(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(host_cores, "busy_elsewhere", lambda: seen.append(1) or 10**6)  # every core busy
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    engine = StreamingEngine(model, list(model), torch.device("cpu"), config=EngineConfig())
    try:
        assert seen and engine.worker.submit(0, torch.get_num_threads).result() == 1
    finally:
        engine.close()
    explicit = StreamingEngine(model, list(model), torch.device("cpu"), config=EngineConfig(host_threads=2))
    try:
        assert explicit.worker.submit(0, torch.get_num_threads).result() == 2  # an explicit count wins
    finally:
        explicit.close()
