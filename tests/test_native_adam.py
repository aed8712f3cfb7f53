"""The one-pass Adam(W) for bf16 gradients (``optim/native_adam.c``), built at first use.

It must be torch's fused AdamW on the widened gradients bit for bit (the bf16-gradient path trains exactly
like the fp32 one: tests/test_bf16_grads.py), across parameters with vector tails, gaps between them,
pieces with different step counts, AdamW, Adam with L2 decay, ``maximize`` and both lerp branches, and
with the work split over threads. Its load-time check must refuse a variant that differs in a last bit,
and without a compiler (or switched off) the caller gets None and a reason, never a wrong kernel.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from megatrain_lightning.optim import native as native_adam
from megatrain_lightning.optim.adam import AdamHyper, Piece, adam_kernel

HYPERS = [
    AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, maximize=False),
    AdamHyper(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.05, decoupled=False, maximize=False),
    AdamHyper(lr=1e-2, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=True),
]


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A kernel state of the test's own (cache in tmp_path), restored for the tests after it."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    native_adam.reset()
    yield tmp_path
    native_adam.reset()


def _problem(sizes: list[int], gap: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n + gap
    p = torch.randn(pos, generator=g)
    m = torch.randn(pos, generator=g) * 1e-2
    v = torch.rand(pos, generator=g) * 1e-4
    grad = (torch.randn(pos, generator=g) * 1e-2).to(torch.bfloat16)
    return offsets, pos, p, m, v, grad


@pytest.mark.parametrize("hyper", HYPERS, ids=["adamw", "adam-l2", "maximize-big-lerp"])
def test_kernel_equals_torch_fused_adamw_bit_for_bit(hyper: AdamHyper) -> None:
    k = native_adam.kernel()
    assert k is not None, native_adam.unavailable_reason()
    # large enough that two threads split it (runs of >= 4096 elements cut through parameters)
    sizes = [40_000 + 13, 7, 16, 9_000, 33, 65_536, 5]
    offsets, total, p, m, v, grad = _problem(sizes, gap=16, seed=0)
    steps = [torch.tensor(float(s)) for s in (1, 2, 2, 5, 5, 9, 1000)]  # pieces at different steps
    ref = [t.clone() for t in (p, m, v)]
    views = [[t[o : o + n] for o, n in zip(offsets, sizes)] for t in ref]
    g32 = grad.float()
    adam_kernel(views[0], [g32[o : o + n] for o, n in zip(offsets, sizes)], views[1], views[2], steps, hyper)
    before = p.clone()
    k.step(p, m, v, grad, [Piece(o, o + n, grad[o : o + n], s) for o, n, s in zip(offsets, sizes, steps)], hyper, threads=2)
    for name, got, want in zip(("weights", "exp_avg", "exp_avg_sq"), (p, m, v), ref):
        bad = (got != want).nonzero().flatten()
        assert bad.numel() == 0, f"{name}: {bad.numel()} elements differ from torch's kernel, first at {bad[:5].tolist()}"
    gaps = torch.ones(total, dtype=torch.bool)
    for o, n in zip(offsets, sizes):
        gaps[o : o + n] = False
    assert torch.equal(p[gaps], before[gaps])  # padding between parameters is left alone
    assert not torch.equal(p[~gaps], before[~gaps])


def test_load_time_check_refuses_a_variant_one_rounding_off() -> None:
    """The kernel is only used once it reproduces torch; a variant that rounds one line differently (an
    FMA where torch has a multiply and an add, or the reverse) is refused, and so is a tail too short,
    which puts elements of torch's tail loop through the vectorised formula."""
    k = native_adam.kernel()
    assert k is not None, native_adam.unavailable_reason()
    assert native_adam._matches_torch(k)
    other_fma = native_adam.NativeAdam(k._fn, k.flags ^ native_adam._V_FMA, k.width)
    assert not native_adam._matches_torch(other_fma)
    other_width = native_adam.NativeAdam(k._fn, k.flags, 4)
    assert not native_adam._matches_torch(other_width)


def test_built_once_into_the_cache_with_no_partial_files(fresh_kernel: Path) -> None:
    assert native_adam.kernel() is not None, native_adam.unavailable_reason()
    built = list(fresh_kernel.iterdir())
    assert len(built) == 1 and built[0].name.startswith("native_adam-") and built[0].suffix == ".so", built
    stamp = built[0].stat().st_mtime_ns
    native_adam.reset()
    assert native_adam.kernel() is not None
    assert list(fresh_kernel.iterdir()) == built and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_no_compiler_or_switched_off_gives_none_and_a_reason(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.warns(RuntimeWarning, match="kernel is unavailable .no C compiler"):
        assert native_adam.kernel() is None
    assert "no C compiler" in native_adam.unavailable_reason()
    assert list(fresh_kernel.iterdir()) == []
    native_adam.reset()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("MEGATRAIN_NATIVE_ADAM", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning
        assert native_adam.kernel() is None
    assert "MEGATRAIN_NATIVE_ADAM=0" in native_adam.unavailable_reason()


def test_a_failing_build_leaves_no_library_behind(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails (here: an unknown flag) gives None with its message, and nothing in the cache
    that a later run could load."""
    monkeypatch.setattr(native_adam, "CFLAGS", [*native_adam.CFLAGS, "-fno-such-flag-xyz"])
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert native_adam.kernel() is None
    assert "failed" in native_adam.unavailable_reason()
    assert list(fresh_kernel.iterdir()) == []


# ------------------------------------------------------------------------------------------ compact state
def _compact_state(n: int, seed: int, with_low: bool) -> list:
    from megatrain_lightning.engine.store import split_fp32

    g = torch.Generator().manual_seed(seed)
    hi = torch.empty(n, dtype=torch.bfloat16)
    lo = torch.empty(n, dtype=torch.int16)
    split_fp32((torch.randn(n, generator=g) * 0.02).view(torch.int32), hi, lo, torch.empty(n, dtype=torch.int32))
    m = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
    v = (torch.rand(n, generator=g) * 1e-6).to(torch.bfloat16)
    return [hi, lo if with_low else None, m, v]


@pytest.mark.parametrize("with_low", [True, False], ids=["compact", "plain-bf16-masters"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32-grads", "bf16-grads"])
def test_compact_kernel_equals_the_chunked_torch_path(with_low: bool, grad_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compact_adam_step`` with the one-pass kernel against its chunked torch path, bit for bit: weights
    (both halves) and the stochastically rounded moments, over three steps, with spans of odd lengths,
    gaps, a span whose dither indices wrap around the table's period, and two threads."""
    from megatrain_lightning.optim import compact as host_adam
    from megatrain_lightning.optim.kernels import step_compact as compact_adam_step

    k = native_adam.kernel()
    assert k is not None and k.compact, native_adam.unavailable_reason()
    sizes, gap = [150_001, 37, 16, 70_000 + 9], 13
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n + gap
    g = torch.Generator().manual_seed(5)
    grads = [(torch.randn(pos, generator=g) * 1e-3).to(grad_dtype) for _ in range(3)]
    # a first step whose dither offset puts the period's end inside the first span
    first = next(s for s in range(1, 10_000) if host_adam.DITHER_P - 120_000 < s * host_adam.DITHER_STEP % host_adam.DITHER_P < host_adam.DITHER_P - 30_000)
    hyper = HYPERS[0] if with_low else HYPERS[1]

    def train(native: bool) -> list:
        state = _compact_state(pos, 1, with_low)
        with monkeypatch.context() as mp:
            if not native:
                mp.setattr(native_adam, "kernel", lambda: None)
            mp.setattr(torch, "get_num_threads", lambda: 2)
            for i, grad in enumerate(grads):
                step = torch.tensor(float(first + i))
                spans = [Piece(o, o + n, grad[o : o + n], step) for o, n in zip(offsets, sizes)]
                compact_adam_step(*state, spans, hyper)
        return state

    got, want = train(True), train(False)
    for name, a, b in zip(("high half", "low half", "exp_avg", "exp_avg_sq"), got, want):
        if b is None:
            continue
        bad = (a.view(torch.int16) != b.view(torch.int16)).nonzero().flatten()
        assert bad.numel() == 0, f"{name}: {bad.numel()} elements differ from the chunked path, first at {bad[:5].tolist()}"
    assert not torch.equal(got[0], _compact_state(pos, 1, with_low)[0])  # it trained


def test_compact_check_refuses_a_kernel_that_rounds_or_steps_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time check of the compact kernel (its variant is the one the fp32 check chose) fails for a
    kernel whose stochastic rounding reads the dither one element off, or whose weight update is off by a
    part in 10^6 of the learning rate."""
    import dataclasses

    k = native_adam.kernel()
    assert k is not None and k.compact
    assert native_adam._compact_matches(k)
    real = native_adam.NativeAdam.compact_step
    monkeypatch.setattr(native_adam.NativeAdam, "compact_step",
                        lambda self, *a, **kw: real(self, *a[:6], a[6][1:], **kw))  # dither shifted
    assert not native_adam._compact_matches(k)
    monkeypatch.setattr(native_adam.NativeAdam, "compact_step", lambda self, *a, **kw: real(
        self, *a[:5], dataclasses.replace(a[5], lr=a[5].lr * (1 + 1e-6)), *a[6:], **kw))
    assert not native_adam._compact_matches(k)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_compact_training_is_the_same_with_and_without_the_kernel(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compact-state training run (overlapped updates, bf16 gradients in bf16-mixed) with the one-pass
    kernel equals the one in torch ops: every loss and every weight."""
    from conftest import fit, megatrain
    from zoo import TinyLlama

    assert native_adam.kernel() is not None and native_adam.kernel().compact
    with_kernel = fit(TinyLlama, megatrain(host_state="compact"), precision=precision, max_steps=5)
    monkeypatch.setattr(native_adam, "kernel", lambda: None)
    without = fit(TinyLlama, megatrain(host_state="compact"), precision=precision, max_steps=5)
    assert with_kernel.losses == without.losses
    diff = [k for k in with_kernel.state if not torch.equal(with_kernel.state[k], without.state[k])]
    assert not diff, diff[:4]
    assert any(not torch.equal(with_kernel.init_state[k], with_kernel.state[k]) for k in with_kernel.state)
