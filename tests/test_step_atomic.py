"""A step is all-or-nothing (issue 14): faults injected at every point of a step with the host updates
overlapping the backward, and the non-finite guard.

After an exception or a Ctrl-C anywhere in a step, the module and the optimizer state are exactly the
state before the step or exactly the one after it, and so is any checkpoint written on the exception
(``ModelCheckpoint(save_on_exception=True)``); where the step's host updates had begun and cannot be undone,
the strategy refuses to save and says why. A Ctrl-C waits for the step's end, so its checkpoint is the
finished step, and resuming from it trains on exactly as the uninterrupted run.
"""

from __future__ import annotations

import os
import signal
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import fit, megatrain
from megatrain_lightning.engine import StreamingEngine
from megatrain_lightning.errors import CheckpointError
from zoo import TinyLlama

# (the README runs the suite with --dist loadfile: the last tests here read what the earlier ones recorded, OUTCOMES)
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STEP = 2  # the faulted step (0-based): two clean steps before it, the last of the first epoch
# 3 blocks, an untied head (two resident parts); epochs of STEP + 1 batches, so that a checkpoint written at
# the faulted step's end resumes at an epoch boundary (plain dataloaders resume there, not mid-epoch)
FACTORY = partial(TinyLlama, optimizer="adamw", lr=3e-3, scheduler=False, n_train=4 * (STEP + 1))


def _state(run_module: pl.LightningModule, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Weights, and every optimizer state tensor (moments, step counts), as plain cloned tensors."""
    out = {f"w:{k}": v.detach().clone() for k, v in run_module.state_dict().items()}
    opt = trainer.optimizers[0]
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for k, v in opt.state.get(p, {}).items():
            out[f"s:{i}:{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
    return out


def _checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    from megatrain_lightning.checkpoint_io import ShardedCheckpointIO

    ckpt = ShardedCheckpointIO().load_checkpoint(path, weights_only=False)
    out = {f"w:{k}": v for k, v in ckpt["state_dict"].items()}
    opt = ckpt["optimizer_states"][0]
    for i, st in opt["state"].items():
        for k, v in st.items():
            out[f"s:{i}:{k}"] = v if torch.is_tensor(v) else torch.tensor(float(v))
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


# Every block and the embedding updated on the device, their newer state held there between the clean steps
# (engine/device_update.py, "home on demand"): an exception must send it home before anything is saved
ON_DEVICE = dict(update_on_device=3, cache_weights=3)


def _references(**options: Any) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, steps in (("pre", STEP), ("post", STEP + 1)):
        run = fit(FACTORY, megatrain(**options), max_steps=steps)
        out[name] = _state(run.module, run.trainer)
    return out


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    """The uninterrupted run's state before and after the faulted step."""
    return _references()


@pytest.fixture(scope="module")
def references_on_device() -> dict[str, dict[str, torch.Tensor]]:
    return _references(**ON_DEVICE)


class Fault(Exception):
    pass


def _inject(monkeypatch: pytest.MonkeyPatch, where: str, nth: int, sigint: bool = False, interrupt: bool = False) -> None:
    """Raise (or send SIGINT, or raise KeyboardInterrupt as a signal handler would) at the ``nth`` call of ``where``
    during step STEP."""
    calls = {"step": 0, "n": 0}

    def fault() -> None:
        if sigint:
            os.kill(os.getpid(), signal.SIGINT)
        elif interrupt:
            raise KeyboardInterrupt
        else:
            raise Fault(f"injected at {where} #{nth}")

    if where == "block backward":  # a block's gradients about to go home: 3 blocks, last first
        original = StreamingEngine.offload_grads

        def offload_grads(engine: StreamingEngine, block: int, grads: Any) -> None:
            if calls["step"] == STEP:
                calls["n"] += 1
                if calls["n"] == nth:
                    fault()
            original(engine, block, grads)

        monkeypatch.setattr(StreamingEngine, "offload_grads", offload_grads)
    elif where == "block forward":
        original_fwd = StreamingEngine.acquire

        def acquire(engine: StreamingEngine, block: int) -> Any:
            if calls["step"] == STEP and engine.state.phase.value == "forward":
                calls["n"] += 1
                if calls["n"] == nth:
                    fault()
            return original_fwd(engine, block)

        monkeypatch.setattr(StreamingEngine, "acquire", acquire)
    elif where == "host update":  # inside an overlapped update, on the host worker
        from megatrain_lightning.optim import StoreUpdate

        original_init, original_update = StoreUpdate.__init__, StoreUpdate.__call__

        def init(self: StoreUpdate, *args: Any) -> None:  # main thread, as the step's backward starts
            original_init(self, *args)
            self.faulted_step = calls["step"] == STEP  # type: ignore[attr-defined]

        def update(self: StoreUpdate, store: Any) -> None:
            # the step's updates, by the step that made them: the last may run after its batch ended (on a loaded
            # host, past on_train_batch_end's count: the fault then came in no step, and the test saw no exception)
            if getattr(self, "faulted_step", False):
                calls["n"] += 1
                if calls["n"] == nth:
                    raise Fault(f"injected in host update #{nth}")
            original_update(self, store)

        monkeypatch.setattr(StoreUpdate, "__init__", init)
        monkeypatch.setattr(StoreUpdate, "__call__", update)

    class StepCounter(pl.Callback):
        megatrain_reads_weights = False

        def on_train_batch_end(self, *args: Any) -> None:
            calls["step"] += 1

    _inject.counter = StepCounter()  # type: ignore[attr-defined]


OUTCOMES: list[tuple[str, int, str]] = []  # (where, nth, what the state was): filled by the test below
POINTS = [("block forward", n) for n in (1, 3)] + [("block backward", n) for n in (1, 2, 3)] + [
    ("host update", n) for n in (1, 3)]


@pytest.mark.parametrize(("where", "nth"), POINTS, ids=[f"{w}-{n}" for w, n in POINTS])
def test_an_exception_leaves_the_state_before_or_after_the_step_or_refuses_to_save(
    where: str, nth: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, references: dict
) -> None:
    _fault_and_check(where, nth, tmp_path, monkeypatch, references, OUTCOMES)


ON_DEVICE_OUTCOMES: list[tuple[str, int, str]] = []
ON_DEVICE_POINTS = POINTS[:-1]  # one host update per step is left (the untied head's)


@pytest.mark.parametrize(("where", "nth"), ON_DEVICE_POINTS, ids=[f"{w}-{n}" for w, n in ON_DEVICE_POINTS])
def test_the_same_with_the_updates_on_the_device(where: str, nth: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  references_on_device: dict) -> None:
    _fault_and_check(where, nth, tmp_path, monkeypatch, references_on_device, ON_DEVICE_OUTCOMES, **ON_DEVICE)


def test_with_the_updates_on_the_device_a_fault_before_them_saves_the_state_before_the_step() -> None:
    """The state the device held from the clean steps went home with the exception: a fault in the forward
    saves exactly the state before the step."""
    seen = {(w, n): o for w, n, o in ON_DEVICE_OUTCOMES}
    assert len(seen) == len(ON_DEVICE_POINTS), ON_DEVICE_OUTCOMES
    assert seen[("block forward", 1)] == seen[("block forward", 3)] == "pre", ON_DEVICE_OUTCOMES


def _fault_and_check(where: str, nth: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, references: dict,
                     outcomes: list, **options: Any) -> None:
    _inject(monkeypatch, where, nth)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, save_last=False, every_n_train_steps=0,
                           save_top_k=0)
    with pytest.raises((Fault, CheckpointError)) as err:
        fit(FACTORY, megatrain(**options), max_steps=STEP + 2, callbacks=[_inject.counter, ckpt],
            enable_checkpointing=True)
    saved = sorted(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    strategy_refused = isinstance(err.value, CheckpointError) or isinstance(err.value.__context__, CheckpointError)
    if strategy_refused:
        said = str(err.value if isinstance(err.value, CheckpointError) else err.value.__context__)
        assert "refuses to save" in said and "EngineConfig(overlap_optimizer=False)" in said, said
        assert not saved, "a checkpoint of a torn step was written"
        outcomes.append((where, nth, "refused"))
        return
    assert len(saved) == 1, saved
    got = _checkpoint_state(saved[0])
    outcomes.append((where, nth, "pre" if _same(got, references["pre"]) else "post"))
    diff = {n: [k for k in got if not torch.equal(got[k], references[n][k].to(got[k].dtype))] for n in ("pre", "post")}
    assert _same(got, references["pre"]) or _same(got, references["post"]), f"the checkpoint mixes two steps: {diff}"


def test_without_the_overlap_a_fault_in_the_backward_saves_the_state_before_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, references: dict
) -> None:
    """The way out the refusal names (OnExceptionCheckpoint after a fault in the backward, found by a sweep of
    Lightning's callbacks): with the host step after the backward, none of the step's updates has run when the
    backward fails, so the checkpoint holds the state before the step, as Lightning's default strategy's does."""
    outcomes: list[tuple[str, int, str]] = []
    _fault_and_check("block backward", 3, tmp_path, monkeypatch, references, outcomes, overlap_optimizer=False)
    assert outcomes == [("block backward", 3, "pre")], outcomes


def test_both_outcomes_were_seen() -> None:
    """The faults above hit both cases: before any of the step's updates ran (a consistent checkpoint of the
    state before the step), and after (saving refused)."""
    kinds = {o for _, _, o in OUTCOMES}
    assert len(OUTCOMES) == len(POINTS) and {"pre", "refused"} <= kinds, OUTCOMES
    print("\nfault outcomes:", OUTCOMES)


def test_a_torn_step_says_so_in_its_exception_and_when_the_module_is_used_again(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault in the backward after some of the step's host updates ran: the exception carries a note that
    the module's weights now mix two steps (saving was only refused before, when a checkpoint was asked for), and
    a later run on the module warns at setup, unless it resumes from a checkpoint."""
    _inject(monkeypatch, "block backward", 3)
    built: list[pl.LightningModule] = []

    def build() -> pl.LightningModule:
        built.append(FACTORY())
        return built[-1]

    with pytest.raises(Fault) as err:
        fit(build, megatrain(), max_steps=STEP + 2, callbacks=[_inject.counter])
    notes = " ".join(getattr(err.value, "__notes__", []))
    assert "host updates had run when this exception stopped the step" in notes, notes
    assert "ckpt_path='last'" in notes, notes
    monkeypatch.undo()
    trainer = pl.Trainer(strategy=megatrain()(), accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    with pytest.warns(UserWarning, match=r"TinyLlama's weights mix two steps \(the step after global_step 2"):
        trainer.validate(built[-1], dataloaders=built[-1].train_dataloader())


def test_a_step_torn_by_a_keyboard_interrupt_is_said_in_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning ends a fit on a KeyboardInterrupt with sys.exit (no traceback): the torn step's note reached no one."""
    _inject(monkeypatch, "block backward", 3, interrupt=True)
    with pytest.warns(UserWarning, match="host updates had run when this exception stopped"):
        with pytest.raises(SystemExit):  # inside: pytest.warns checks nothing when its block raises
            fit(FACTORY, megatrain(), max_steps=STEP + 2, callbacks=[_inject.counter])


def test_a_ctrl_c_in_the_backward_waits_for_the_step_and_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, references: dict
) -> None:
    # Python's own Ctrl-C handler, as in a fresh process (the strategy holds a SIGINT only where it is; a
    # handler left by an earlier test of this process would take the signal instead), and after the test
    # whatever was there: Lightning's graceful shutdown leaves SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_in_the_backward(tmp_path, monkeypatch, references)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_in_the_backward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, references: dict) -> None:
    _inject(monkeypatch, "block backward", 2, sigint=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, save_top_k=0, every_n_train_steps=0)
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown on KeyboardInterrupt ends in sys.exit(1)
        fit(FACTORY, megatrain(), max_steps=STEP + 2, callbacks=[_inject.counter, ckpt], enable_checkpointing=True)
    saved = sorted(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert len(saved) == 1, saved
    assert _same(_checkpoint_state(saved[0]), references["post"]), "the interrupted step was not completed"
    monkeypatch.undo()
    resumed = fit(FACTORY, megatrain(), max_steps=STEP + 2, ckpt_path=str(saved[0]), weights_only=False)
    straight = fit(FACTORY, megatrain(), max_steps=STEP + 2)
    assert _same(_state(resumed.module, resumed.trainer), _state(straight.module, straight.trainer))


class SeesSigintHandler(TinyLlama):
    """Records, from inside each micro-batch's backward, whether a Ctrl-C there would be held."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.held: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        loss.register_hook(lambda g: self.held.append(signal.getsignal(signal.SIGINT) is not signal.default_int_handler))
        return loss


def test_a_ctrl_c_in_the_backward_of_a_micro_batch_before_the_step_is_held_too() -> None:
    """With accumulation the first micro-batches' backward runs outside the optimizer step: a Ctrl-C there
    stopped the backward at once (the realistic way into a hang of the engine's close, fixed in the host
    worker); it now waits for the micro-batch's end as in the last one."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = fit(partial(SeesSigintHandler, **{**FACTORY.keywords, "n_train": 8}), megatrain(), max_steps=1,
                  accumulate_grad_batches=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert run.module.held == [True, True], run.module.held


# ---------------------------------------------------------------------------------------------- non-finite
class PoisonedLlama(TinyLlama):
    """Its loss is NaN on the batches listed in ``poison`` (0-based batch indices)."""

    def __init__(self, poison: tuple[int, ...] = (), grad_only: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.poison, self.grad_only = set(poison), grad_only

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        if batch_idx in self.poison:
            if self.grad_only:  # a finite loss whose gradient is NaN: sqrt'(0) * 0
                loss = loss + torch.sqrt(self.model.lm_head.weight.sum() * 0) * 0
            else:
                loss = loss * float("nan")
        self.log("loss", loss)
        return loss


def test_a_nonfinite_loss_skips_the_step_bit_for_bit() -> None:
    """skip_nonfinite: the run with a NaN loss at batch 2 ends bit for bit where a run that never saw that
    batch ends (constant LR: the schedule is the one thing a skipped step advances)."""
    poisoned = fit(partial(PoisonedLlama, poison=(2,), optimizer="adamw", lr=3e-3, scheduler=False), megatrain(skip_nonfinite=3),
                   max_steps=5, allow_nonfinite=True)
    assert poisoned.trainer.strategy.precision_plugin.skipped_steps == 1
    # the reference trains on batches 0, 1, 3, 4 (the poisoned one left out of its data)
    ref_factory = partial(_WithoutBatch, drop=2, optimizer="adamw", lr=3e-3, scheduler=False)
    ref = fit(ref_factory, megatrain(), max_steps=4)
    assert _same({k: v for k, v in _state(poisoned.module, poisoned.trainer).items()},
                 {k: v for k, v in _state(ref.module, ref.trainer).items()})


class _WithoutBatch(TinyLlama):
    def __init__(self, drop: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        bs = self.hparams.batch_size
        keep = [i for i in range(len(self.train_data)) if i // bs != drop]
        self.train_data = self.train_data[keep]


def test_consecutive_nonfinite_steps_stop_training_with_the_weights_of_before() -> None:
    with pytest.raises(FloatingPointError, match=r"3 steps in a row had a non-finite loss"):
        fit(partial(PoisonedLlama, poison=(1, 2, 3, 4), optimizer="adamw", lr=3e-3, scheduler=False), megatrain(skip_nonfinite=3),
            max_steps=6, allow_nonfinite=True, callbacks=[_Snapshot()])
    one = fit(partial(TinyLlama, optimizer="adamw", lr=3e-3, scheduler=False), megatrain(), max_steps=1)
    assert _same(_Snapshot.last, {f"w:{k}": v for k, v in one.state.items()}), "a skipped step changed the weights"


class _Snapshot(pl.Callback):
    """The module's weights when training stops (on the exception, before teardown)."""

    megatrain_reads_weights = False
    last: dict[str, torch.Tensor] = {}

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, exc: BaseException) -> None:
        type(self).last = {f"w:{k}": v.detach().clone() for k, v in module.state_dict().items()}


def test_nonfinite_gradients_are_skipped_when_the_step_follows_the_backward() -> None:
    """With clipping the host step follows the backward: a NaN gradient under a finite loss skips the step
    whole; with the overlap it stops training with an error instead of a silent wrong update."""
    run = fit(partial(PoisonedLlama, poison=(1,), grad_only=True, optimizer="adamw", lr=3e-3, scheduler=False),
              megatrain(skip_nonfinite=2), max_steps=3, gradient_clip_val=1.0, allow_nonfinite=True)
    assert run.trainer.strategy.precision_plugin.skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in run.state.values())
    with pytest.raises((FloatingPointError, CheckpointError), match=r"non-finite gradients"):
        fit(partial(PoisonedLlama, poison=(1,), grad_only=True, optimizer="adamw", lr=3e-3, scheduler=False),
            megatrain(skip_nonfinite=2), max_steps=3, allow_nonfinite=True)


def test_without_the_option_a_nonfinite_loss_goes_into_the_weights_as_with_lightning() -> None:
    """The default keeps parity with Lightning's own strategies: the NaN reaches the weights."""
    with pytest.raises(AssertionError, match="non-finite training loss"):
        fit(partial(PoisonedLlama, poison=(1,), optimizer="adamw", lr=3e-3, scheduler=False), megatrain(), max_steps=3)
