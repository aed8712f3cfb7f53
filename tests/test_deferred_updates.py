"""Host updates that run on into the next forward (``overlap_next_forward``).

The host optimizer is slowed down here (each store's update sleeps), so that the backward always ends
with updates still queued. Then:

* the worker runs them earliest deadline first: the resident part (embeddings), then the blocks in
  forward order, whatever order their gradients came in;
* the next step's forward starts before the last of them has run, and training is still exact (parity
  with Lightning's default strategy, with an LR scheduler that changes the rate every step);
* whatever reads the weights between steps sees the finished step: the strategy's ``state_dict``, and any
  module hook or undeclared callback between steps, which turn the run-on off.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

import lightning as L
import pytest
import torch

from conftest import assert_parity, fit, megatrain
from megatrain_lightning.engine import RESIDENT, RESIDENT_AFTER
from megatrain_lightning.engine.host_worker import HostWorker
from megatrain_lightning.engine import StreamingEngine
from megatrain_lightning.optim import StoreUpdate
from zoo import ZOO

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SLOW = 0.1  # seconds per store update: far longer than a tiny model's whole backward


class Timeline:
    """Wraps the host updates (slowed) and the engine's weight acquisitions, with times and keys."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int, float]] = []  # (what, key, time)
        self.lock = threading.Lock()
        update_store, acquire = StoreUpdate.__call__, StreamingEngine.acquire
        timeline = self
        self.engine: StreamingEngine | None = None

        def slow_update(update: StoreUpdate, store: Any) -> None:  # on the host worker
            time.sleep(SLOW)
            update_store(update, store)
            timeline.log("update", timeline.key_of(store))

        def logged_acquire(engine: StreamingEngine, block: int) -> Any:
            timeline.engine = engine
            out = acquire(engine, block)
            timeline.log("acquire", block)
            return out

        monkeypatch.setattr(StoreUpdate, "__call__", slow_update)
        monkeypatch.setattr(StreamingEngine, "acquire", logged_acquire)

    def key_of(self, store: Any) -> int:
        """The store's place in the next forward: -1 before the blocks, the block index, or after them."""
        assert self.engine is not None
        for part in self.engine.resident.parts:
            if store is part.store:
                return RESIDENT if part.key == RESIDENT else len(self.engine.stores)
        return self.engine.stores.index(store)

    def log(self, what: str, key: int) -> None:
        with self.lock:
            self.events.append((what, key, time.perf_counter()))

    def updates(self) -> list[int]:
        return [k for what, k, _ in self.events if what == "update"]


def test_updates_run_earliest_deadline_first_into_the_next_forward_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3, scheduler=True)
    ref = fit(factory, None, max_steps=3)
    timeline = Timeline(monkeypatch)
    # own accumulators: with the pool of 4 buffers, the fifth store to send waits for a buffer, i.e. for an
    # update, and so joins the queue later than the order under test assumes
    got = fit(factory, megatrain(grad_buffers=0), max_steps=3)
    assert_parity(ref, got)

    engine = timeline.engine
    assert engine is not None
    n_blocks = len(engine.stores)
    assert [part.key for part in engine.resident.parts] == [RESIDENT, RESIDENT_AFTER]  # untied head: two parts
    per_step = n_blocks + 2
    updates = timeline.updates()
    assert len(updates) == 3 * per_step
    for step in range(3):
        # The worker starts on whatever has landed when it wakes (the final norm and head, sent at the first
        # block's backward, or already more); once that update is done the backward is over, and the rest
        # go in the next forward's order: embeddings, the blocks, the head. (In arrival order they would
        # come head, last block ... first block, embeddings.)
        order = updates[step * per_step:(step + 1) * per_step]
        assert sorted(order) == [RESIDENT, *range(n_blocks + 1)]
        assert order[1:] == sorted(order[1:]), order

    # The second step's forward took block 0 before the first step's last update had run.
    events = timeline.events
    last_update_of_step_1 = [t for what, _, t in events if what == "update"][per_step - 1]
    forward_acquires = [t for what, k, t in events if what == "acquire" and k == 0]
    # acquisitions of block 0 per step: the forward's, then the recompute's (it is not kept)
    second_forward = forward_acquires[2]
    assert second_forward < last_update_of_step_1
    assert engine.stats.update_wait_s >= SLOW  # and the forward waited for updates, as its diagnostics count


def test_host_worker_runs_the_lowest_priority_first_and_fifo_among_equals() -> None:
    worker = HostWorker()
    gate, ran = threading.Event(), []
    first = worker.submit(5, gate.wait)  # holds the worker while the others queue up
    futures = [worker.submit(p, ran.append, name) for p, name in [(3, "c"), (1, "a1"), (2, "b"), (-1, "r"), (1, "a2")]]
    gate.set()
    for f in futures:
        f.result(timeout=5)
    assert first.result() is True
    assert ran == ["r", "a1", "a2", "b", "c"]
    failing = worker.submit(0, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=5)  # an update's error reaches whoever waits for it
    late = worker.submit(9, ran.append, "late")
    worker.shutdown()  # runs what is queued first
    assert late.done() and ran[-1] == "late"
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(0, ran.append, "x")


def test_host_worker_takes_ready_jobs_first_else_the_oldest() -> None:
    """A job whose copy has not landed must not hold the worker while others could run."""
    worker = HostWorker()
    gate, ran = threading.Event(), []
    copies = {"b1": threading.Event(), "b0": threading.Event()}
    worker.submit(9, gate.wait)
    # block 2's copy has landed; blocks 1 and 0 (more urgent) are still in flight
    worker.submit(2, ran.append, "b2")
    f1 = worker.submit(1, lambda: (copies["b1"].wait(), ran.append("b1")), ready=copies["b1"].is_set)
    f0 = worker.submit(0, lambda: (copies["b0"].wait(), ran.append("b0")), ready=copies["b0"].is_set)
    gate.set()
    threading.Timer(0.5, copies["b1"].set).start()
    threading.Timer(1.0, copies["b0"].set).start()
    f0.result(timeout=5), f1.result(timeout=5)
    # b2 ran at once; then nothing was ready, so the oldest (b1) was taken and waited for
    assert ran == ["b2", "b1", "b0"]
    worker.shutdown()


def test_host_worker_threads_leave_the_callers_count_alone() -> None:
    before = torch.get_num_threads()
    worker = HostWorker(threads=1)
    assert torch.get_num_threads() == before
    worker.shutdown()


class HookedLlama(ZOO["llama"]):  # type: ignore[misc, valid-type]
    """A module hook between steps: it may read the weights, so the step must be finished by then."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pending = self.trainer.strategy.engine.updates._all
        self.pending_seen = getattr(self, "pending_seen", 0) + len(pending)


class PendingProbe(L.Callback):
    def __init__(self, reads_weights: bool | None) -> None:
        if reads_weights is not None:
            self.megatrain_reads_weights = reads_weights
        self.pending: list[int] = []
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.pending.append(sum(not f.done() for f in trainer.strategy.engine.updates._all))
        if self.megatrain_reads_weights is False:
            # through the strategy: it waits for the updates still running
            state = trainer.strategy.lightning_module_state_dict()
            self.states.append({k: v.detach().clone() for k, v in state.items()})

    megatrain_reads_weights: bool | None = None


class StateRecorder(L.Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.states.append({k: v.detach().clone() for k, v in module.state_dict().items()})


def test_state_dict_between_steps_is_the_finished_step(monkeypatch: pytest.MonkeyPatch) -> None:
    factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3)
    native = StateRecorder()
    fit(factory, None, max_steps=3, callbacks=[native])
    Timeline(monkeypatch)
    probe = PendingProbe(reads_weights=False)
    fit(factory, megatrain(), max_steps=3, callbacks=[probe])
    assert all(n > 0 for n in probe.pending)  # the updates were still running at the hook...
    for ref, got in zip(native.states, probe.states, strict=True):  # ...and state_dict waited for them
        for name, a in ref.items():
            torch.testing.assert_close(got[name], a, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("who", ["module hook", "undeclared callback", "callback that reads weights"])
def test_anything_that_may_read_weights_between_steps_turns_the_run_on_off(who: str, monkeypatch: pytest.MonkeyPatch) -> None:
    Timeline(monkeypatch)
    if who == "module hook":
        module_factory = partial(HookedLlama, optimizer="adamw", lr=3e-3)
        callbacks: list[L.Callback] = []
    else:
        module_factory = partial(ZOO["llama"], optimizer="adamw", lr=3e-3)
        callbacks = [PendingProbe(reads_weights=None if who == "undeclared callback" else True)]
    run = fit(module_factory, megatrain(), max_steps=2, callbacks=callbacks)
    if who == "module hook":
        assert run.module.pending_seen == 0
    else:
        assert callbacks[0].pending == [0, 0]  # every update had run before the hook


def test_run_on_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    Timeline(monkeypatch)
    probe = PendingProbe(reads_weights=False)
    fit(partial(ZOO["llama"], optimizer="adamw", lr=3e-3), megatrain(overlap_next_forward=False), max_steps=2, callbacks=[probe])
    assert probe.pending == [0, 0]


def test_lightnings_default_callbacks_keep_the_run_on(tmp_path: Any) -> None:
    """Progress bar, model summary and checkpointing (Lightning's defaults) read no weights between steps
    (checkpoints go through the strategy, which waits): the updates still run on into the next forward."""
    from megatrain_lightning import MegaTrainStrategy
    from test_streaming import HooklessNet, _loader

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MegaTrainStrategy(), max_steps=2, logger=False,
                        default_root_dir=tmp_path, enable_progress_bar=True, enable_model_summary=True,
                        enable_checkpointing=True)
    assert len(trainer.callbacks) >= 3  # progress bar, model summary, checkpointing (Rich or plain variants)
    trainer.fit(HooklessNet(depth=2), _loader())
    assert trainer.strategy.precision_plugin.defer_updates


class UpdateListProbe(L.Callback):
    megatrain_reads_weights = False  # it counts futures only

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.sizes.append(len(trainer.strategy.engine.updates._all))


def test_finished_updates_are_not_kept_over_a_long_run() -> None:
    """Running on, the step never waits for all updates at once: the engine must not keep one future
    per update for the whole run."""
    probe = UpdateListProbe()
    fit(partial(ZOO["llama"], optimizer="adamw", lr=3e-3), megatrain(), max_steps=8, callbacks=[probe])
    stores = 2 + len(ZOO["llama"]().model.model.layers)  # blocks and the two resident parts
    assert len(probe.sizes) == 8 and max(probe.sizes) <= 2 * stores, probe.sizes


def test_host_worker_shuts_down_after_interrupts_mid_submit() -> None:
    """A KeyboardInterrupt raised in the caller mid-``submit`` (a signal handler runs between any two bytecodes; a
    second Ctrl-C raises at once) left the worker's condition lock held or its wake-up lost: the engine's close
    then hung in ``Thread.join`` for ever (2 of 70 random interrupts of a fit). Every trial's shutdown must return
    and run every job that was queued."""
    import random
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    rng = random.Random(0)
    try:
        for trial in range(300):
            worker, futures = HostWorker(), []
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, 0.0004))
                    for _ in range(200):
                        futures.append(worker.submit(0, lambda: None))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                pass
            done = threading.Thread(target=worker.shutdown, daemon=True)
            done.start()
            done.join(20)
            assert not done.is_alive(), f"trial {trial}: HostWorker.shutdown hung after an interrupt mid-submit"
            assert all(f.done() for f in futures), f"trial {trial}: queued jobs did not run"
    finally:
        signal.signal(signal.SIGALRM, previous)
