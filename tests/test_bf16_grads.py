"""bf16 gradients straight into the host update (``bf16_grads=True``; off by default).

A block computed in bf16 has bf16 gradients. When its update overlaps the backward and nothing
accumulates, they travel to the host as they are and the host AdamW widens them: in a register, with the
one-pass kernel (``optim/native_adam.c``), or chunk by chunk into scratch without it
(``optim/adam.step_half_chunked``); both paths are tested. Widening bf16 to fp32 is exact and both
take the same elementwise arithmetic per element as a whole-parameter call, so the training run must
equal the one with ``bf16_grads=False`` (gradients widened on the device, fp32 on the host) bit for bit:
every loss and every weight. Tiny chunks make pieces of one parameter fall into several chunks.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from megatrain_lightning.optim import adam as host_adam
from megatrain_lightning.optim import native as native_adam

from conftest import fit, megatrain
from zoo import TinyLlama, TinyQwen2


@pytest.fixture(params=["native", "chunked"])
def half_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The one-pass kernel (it must be available here: CI has a C compiler), or the chunked widening."""
    if request.param == "chunked":
        monkeypatch.setattr(native_adam, "kernel", lambda: None)
    else:
        assert native_adam.kernel() is not None, native_adam.unavailable_reason()
    return request.param


class EngineProbe(pl.Callback):
    """Reads the engine's counters at the end of training (before the strategy's teardown)."""

    megatrain_reads_weights = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = trainer.strategy.engine.stats
        self.half_sent, self.lent = stats.half_sent, stats.grads_lent


def _run(factory: Any, bf16_grads: bool, **strategy: Any) -> tuple[Any, EngineProbe]:
    probe = EngineProbe()
    run = fit(factory, megatrain(bf16_grads=bf16_grads, **strategy), precision="bf16-mixed", callbacks=[probe], max_steps=6)
    return run, probe


def _assert_identical(a: Any, b: Any) -> None:
    assert a.losses == b.losses, f"losses differ:\n{a.losses}\n{b.losses}"
    assert a.state.keys() == b.state.keys()
    diff = [k for k in a.state if not torch.equal(a.state[k], b.state[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:4]}"


@pytest.mark.parametrize(
    ("factory", "strategy"),
    [
        (lambda: TinyLlama(param_groups=True), dict(grad_buffers=0)),  # own bf16 buffers, two param groups
        (TinyQwen2, dict(grad_buffers=2)),  # pooled buffers read as bf16; tied embeddings (resident, fp32)
        (TinyLlama, dict(host_state="compact", grad_buffers=0)),  # the compact kernel widens them too
    ],
    ids=["llama-groups-own", "qwen2-pool", "llama-compact"],
)
def test_bf16_gradients_train_exactly_like_fp32_gradients(
    factory: Any, strategy: dict, half_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_adam, "CHUNK_ELEMS", 48)  # pieces of one parameter in several chunks
    ref, ref_probe = _run(factory, False, **strategy)
    got, got_probe = _run(factory, True, **strategy)
    assert ref_probe.half_sent == 0
    assert got_probe.half_sent == 3 * 6, got_probe.half_sent  # every block (3) of every step (6)
    if strategy.get("grad_buffers"):
        assert got_probe.lent > 0
    _assert_identical(ref, got)
    assert any(not torch.equal(ref.init_state[k], ref.state[k]) for k in ref.state)  # it trained


def test_bf16_path_leaves_no_grad_and_fp32_runs_do_not_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """In fp32 the gradients are fp32: nothing travels as bf16. In bf16 the default takes the bf16 path
    where the one-pass kernel is (and not where it is not, nor with ``bf16_grads=False``); the blocks'
    parameters have no ``.grad`` after a step whose updates took it (their gradients went into the update)."""

    class Grads(EngineProbe):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            engine = trainer.strategy.engine
            engine.settle()  # let the updates running on finish before looking
            self.block_grads = [p.grad for s in engine.stores for p in s.params]

    probe = Grads()
    fit(TinyLlama, megatrain(bf16_grads=True), precision="32-true", callbacks=[probe], max_steps=3)
    assert probe.half_sent == 0
    probe = Grads()
    fit(TinyLlama, megatrain(bf16_grads=False), precision="bf16-mixed", callbacks=[probe], max_steps=3)
    assert probe.half_sent == 0
    assert native_adam.kernel() is not None, native_adam.unavailable_reason()
    for strategy in (megatrain(bf16_grads=True), megatrain()):  # the default: on, the kernel being there
        probe = Grads()
        fit(TinyLlama, strategy, precision="bf16-mixed", callbacks=[probe], max_steps=3)
        assert probe.half_sent > 0
        assert all(g is None for g in probe.block_grads)
    monkeypatch.setattr(native_adam, "kernel", lambda: None)  # no compiler: the default is fp32 gradients
    probe = Grads()
    fit(TinyLlama, megatrain(), precision="bf16-mixed", callbacks=[probe], max_steps=3)
    assert probe.half_sent == 0


def test_half_kernel_equals_whole_parameter_kernel(half_path: str) -> None:
    """The bf16-gradient update (one-pass kernel, or chunked widening) against ``step_fp32`` on widened
    gradients, bit for bit, with parameter sizes that are not multiples of 16 (vector tails) and chunks
    that cut parameters."""
    from megatrain_lightning.engine.layout import FlatLayout
    from megatrain_lightning.optim.adam import AdamHyper, Piece, step_fp32, step_half_chunked

    g = torch.Generator().manual_seed(0)
    shapes = [(37,), (5, 19), (64,), (3,), (130, 7)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    layout = FlatLayout(params)
    n = layout.numel

    def state() -> tuple[torch.Tensor, ...]:
        gg = torch.Generator().manual_seed(1)
        master = torch.zeros(n)
        for v, p in zip(layout.views(master), params):
            v.copy_(p.detach())
        m = torch.zeros(n)
        v = torch.zeros(n)
        for mv, vv in zip(layout.views(m), layout.views(v)):
            mv.copy_(torch.randn(mv.shape, generator=gg) * 1e-3)
            vv.copy_(torch.rand(vv.shape, generator=gg) * 1e-6)
        return master, m, v

    grad16 = torch.zeros(n, dtype=torch.bfloat16)
    for view, p in zip(layout.views(grad16), params):
        view.copy_(torch.randn(p.shape, generator=g) * 1e-2)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False)

    ref_master, ref_m, ref_v = state()
    steps = [torch.tensor(4.0) for _ in params]  # incremented already, as the caller does
    wide = grad16.float()
    step_fp32(ref_master, ref_m, ref_v, [Piece(o, o + p.numel(), wide[o : o + p.numel()], s)
                                          for o, p, s in zip(layout.offsets, params, steps)], hyper)
    for chunk in (16, 48, 1 << 20):
        host_adam.CHUNK_ELEMS = chunk
        try:
            master, m, v = state()
            steps = [torch.tensor(4.0) for _ in params]  # incremented already, as the caller does
            pieces = [Piece(o, o + p.numel(), grad16[o : o + p.numel()], s) for o, p, s in zip(layout.offsets, params, steps)]
            kernel = native_adam.kernel()
            if kernel is not None:
                kernel.step(master, m, v, grad16, pieces, hyper)
            else:
                step_half_chunked(master, m, v, pieces, hyper)
        finally:
            host_adam.CHUNK_ELEMS = None
        assert torch.equal(master, ref_master) and torch.equal(m, ref_m) and torch.equal(v, ref_v), chunk


def test_a_store_lets_go_of_the_gradient_buffer_it_no_longer_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose updates do not overlap its backward (the one that tries a placement, on a GPU) fills fp32
    accumulators (4 B/param); the overlapped steps after it send bf16 into buffers of half that size. A store
    must then hold one of them, not both: on the H200 a 7B run at 128 K tokens kept both, its host memory
    13.7 GB over the plan, and the steps after the tried one no longer fitted the 126 GiB host. Exact either
    way: the same run as with fp32 gradients throughout, bit for bit. The idle accumulator itself becomes the
    bf16 buffer: freeing 30 GB of pinned accumulators and pinning 15 GB of new buffers cost the 7B's first
    overlapped step 4.5 s on the H200."""
    from megatrain_lightning.strategy import MegaTrainStrategy

    overlap = MegaTrainStrategy._overlap_target
    seen = {"n": 0}

    def first_two_without(self: MegaTrainStrategy) -> Any:
        seen["n"] += 1
        return None if seen["n"] <= 2 else overlap(self)

    monkeypatch.setattr(MegaTrainStrategy, "_overlap_target", first_two_without)

    class Buffers(EngineProbe):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            engine = trainer.strategy.engine
            engine.settle()
            self.both = getattr(self, "both", 0) + sum(s.grad is not None and s._own_half_grad is not None
                                                       for s in engine.stores)
            self.fp32 = [s.grad is not None for s in engine.stores]
            if trainer.global_step == 2:  # the last step without overlap: each store's fp32 accumulator
                self.accumulators = [s.grad.data_ptr() for s in engine.stores]
            if trainer.global_step == 3:  # the first overlapped one: its bf16 gradients landed in that buffer
                self.reused = [s._own_half_grad is not None and s._own_half_grad.data_ptr() == a
                               for s, a in zip(engine.stores, self.accumulators)]

    ref = fit(TinyLlama, megatrain(bf16_grads=False, grad_buffers=0), precision="bf16-mixed", max_steps=6)
    seen["n"] = 0
    probe = Buffers()
    got = fit(TinyLlama, megatrain(bf16_grads=True, grad_buffers=0), precision="bf16-mixed", callbacks=[probe],
              max_steps=6)
    assert probe.half_sent == 3 * 4, probe.half_sent  # the 3 blocks of the 4 overlapped steps
    assert probe.both == 0 and not any(probe.fp32), (probe.both, probe.fp32)
    assert all(probe.reused), probe.reused  # nothing freed and allocated (pinned, on a GPU) again
    _assert_identical(ref, got)
