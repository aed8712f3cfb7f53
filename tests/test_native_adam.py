"""The one-pass Adam(W) for bf16 gradients (``engine/native_adam.c``), built at first use.

It must be torch's fused AdamW on the widened gradients bit for bit (the bf16-gradient path trains exactly
like the fp32 one: tests/test_bf16_grads.py), across parameters with vector tails, gaps between them,
pieces with different step counts, AdamW, Adam with L2 decay, ``maximize`` and both lerp branches, and
with the work split over threads. Its load-time check must refuse a variant that differs in a last bit,
and without a compiler (or switched off) the caller gets None and a reason, never a wrong kernel.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain_lightning.engine import native_adam
from megatrain_lightning.engine.host_adam import AdamHyper, Piece, adam_kernel

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
    k.step(p, m, v, grad, [Piece(o, o + n, s) for o, n, s in zip(offsets, sizes, steps)], hyper, threads=2)
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
    assert native_adam.kernel() is None
    assert "no C compiler" in native_adam.unavailable_reason()
    assert list(fresh_kernel.iterdir()) == []
    native_adam.reset()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("MEGATRAIN_NATIVE_ADAM", "0")
    assert native_adam.kernel() is None
    assert "MEGATRAIN_NATIVE_ADAM=0" in native_adam.unavailable_reason()


def test_a_failing_build_leaves_no_library_behind(fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that fails (here: an unknown flag) gives None with its message, and nothing in the cache
    that a later run could load."""
    monkeypatch.setattr(native_adam, "CFLAGS", [*native_adam.CFLAGS, "-fno-such-flag-xyz"])
    assert native_adam.kernel() is None
    assert "failed" in native_adam.unavailable_reason()
    assert list(fresh_kernel.iterdir()) == []
