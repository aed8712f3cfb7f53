"""The one-pass host Adam(W) kernels (``native_adam.c``): built at first use, checked against torch.

Two updates where torch has no single kernel, on a host step bound by memory bandwidth:

- fp32 state from bf16 gradients. torch's fused CPU AdamW takes gradients of the parameter's dtype only,
  so a store holding bf16 gradients (``FlatStore.hold_half_grad``) would have to widen them into scratch,
  one more pass over memory per chunk; on the H200 host that pass cost more than the bytes it saved.
  Here each gradient is widened in a register: 26 bytes of host memory traffic per parameter and step
  (read fp32 weight and both moments, bf16 gradient; write the three back) against 28 for torch's kernel
  on fp32 gradients. H200 host: 4.6-4.9 against 4.3 G params/s.
- compact state (``compact.py``): join the weight's halves, the same arithmetic, split,
  round the moments stochastically, per element: 16-18 bytes per parameter against the chunked torch
  path's 14 passes. H200 host: 5.4 against 1.3 G params/s (torch's fp32 kernel: 4.3).

Build: the system C compiler (``$CC`` or ``cc``) with ``-O3 -march=native -ffp-contract=off -fopenmp``,
once per source and CPU, into ``$MEGATRAIN_CACHE`` (default ``~/.cache/megatrain_lightning``), written to a
temporary name and renamed, so concurrent first uses cannot load a half-written library. Then a check:
the kernel must reproduce torch's fused kernel on the widened gradients bit for bit, over AdamW, Adam
with L2 decay, ``maximize``, both lerp branches and every tail length; of the variants compiled (where
torch's build may or may not have fused a multiply-add), the first that does is used. No compiler, a
failed build or no exact variant: :func:`kernel` returns None (with a warning, once) and the callers take
their torch paths (``adam.py``, ``compact.py``), with the reason in :func:`unavailable_reason`.
``MEGATRAIN_NATIVE_ADAM=0`` turns the kernel off (for side-by-side measurements).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Sequence

import torch

from ..engine.store import split_fp32
from .adam import AdamHyper, Piece, adam_kernel
from .compact import DITHER_P, DITHER_STEP, DITHER_V, dither_table, step_compact_chunked


SOURCE = Path(__file__).with_name("native_adam.c")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
# The variants (native_adam.c's flags), tried in order: torch's own vector path's spelling first.
_V_FMA, _V_FMA_SQ, _WD_FMA = 1, 2, 4
_VARIANTS = [v | w for v in (_V_FMA, 0, _V_FMA_SQ) for w in (_WD_FMA, 0)]


class _CPiece(ctypes.Structure):
    _fields_ = [("start", ctypes.c_int64), ("end", ctypes.c_int64), ("tail", ctypes.c_int64), ("step", ctypes.c_double)]


class _CHyper(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double), ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double), ("decoupled", ctypes.c_int32), ("maximize", ctypes.c_int32),
    ]


class _CSpan(ctypes.Structure):
    _fields_ = [("start", ctypes.c_int64), ("end", ctypes.c_int64), ("tail", ctypes.c_int64), ("step", ctypes.c_double),
                ("grad", ctypes.c_void_p), ("grad_bf16", ctypes.c_int32)]


def _c_hyper(hyper: AdamHyper) -> _CHyper:
    return _CHyper(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
                   int(hyper.decoupled), int(hyper.maximize))


class NativeAdam:
    """The loaded kernel, with the variant and torch's vector width that reproduce torch exactly.

    ``compact``: whether the compact-state kernel also reproduces ``compact.py``'s chunked update
    bit for bit (checked at load after the variant is chosen); without it that path stays in torch ops.
    """

    def __init__(self, fn: ctypes._CFuncPtr, flags: int, width: int, compact_fn: ctypes._CFuncPtr | None = None) -> None:
        self._fn = fn
        self._compact_fn = compact_fn
        self.flags = flags
        self.width = width  # torch's float vector width: a parameter's last numel % width elements are its tail
        self.compact = False

    def compact_step(
        self,
        master: torch.Tensor,
        master_low: torch.Tensor | None,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        spans: Sequence[Piece],
        hyper: AdamHyper,
        dither: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> list[Piece]:
        """The compact update (``compact.step_compact_chunked``) of ``spans`` but their tails, in place;
        returns the tails (each span's last ``len % width`` elements, as spans) for the caller's chunked
        path, which runs torch's own tail loop on them. ``dither``: ``compact.dither_table`` (default)."""
        assert self._compact_fn is not None
        for t in (master, exp_avg, exp_avg_sq):
            assert t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu"
        assert master_low is None or (master_low.dtype == torch.int16 and master_low.is_contiguous())
        dither = dither_table(16) if dither is None else dither
        assert dither.dtype == torch.int32 and dither.numel() >= DITHER_P
        arr = (_CSpan * len(spans))()
        tails = []
        for k, sp in enumerate(spans):
            assert sp.grad.is_contiguous() and sp.grad.dtype in (torch.float32, torch.bfloat16)
            tail = sp.end - (sp.end - sp.start) % self.width
            arr[k].start, arr[k].end, arr[k].tail, arr[k].step = sp.start, sp.end, tail, float(sp.step)
            arr[k].grad, arr[k].grad_bf16 = sp.grad.data_ptr(), int(sp.grad.dtype == torch.bfloat16)
            if tail < sp.end:
                tails.append(Piece(tail, sp.end, sp.grad[tail - sp.start :], sp.step))
        self._compact_fn(
            ctypes.c_void_p(master.data_ptr()),
            ctypes.c_void_p(master_low.data_ptr() if master_low is not None else None),
            ctypes.c_void_p(exp_avg.data_ptr()), ctypes.c_void_p(exp_avg_sq.data_ptr()),
            arr, ctypes.c_int64(len(spans)), ctypes.byref(_c_hyper(hyper)), ctypes.c_int(self.flags),
            ctypes.c_int(threads or torch.get_num_threads()), ctypes.c_void_p(dither.data_ptr()),
            ctypes.c_int64(DITHER_P), ctypes.c_int64(DITHER_STEP), ctypes.c_int64(DITHER_V),
        )
        return tails

    def step(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        pieces: Sequence[Piece],
        hyper: AdamHyper,
        threads: int | None = None,
    ) -> None:
        """Update ``master`` and the moments (flat fp32, contiguous) in place from bf16 ``grad`` (same
        layout; the pieces' own ``grad`` are not read) over ``pieces``: whole parameters, sorted and
        disjoint, steps already incremented.

        The kernel runs with the GIL released (ctypes) on ``threads`` OpenMP threads (default: torch's
        intra-op count); then each parameter's tail goes through torch's own kernel in one call.
        """
        if not pieces:
            return
        for t in (master, exp_avg, exp_avg_sq):
            assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
        assert grad.dtype == torch.bfloat16 and grad.is_contiguous() and grad.numel() >= pieces[-1].end
        arr = (_CPiece * len(pieces))()
        tails = []
        for k, pc in enumerate(pieces):
            tail = pc.end - (pc.end - pc.start) % self.width
            arr[k].start, arr[k].end, arr[k].tail, arr[k].step = pc.start, pc.end, tail, float(pc.step)
            if tail < pc.end:
                tails.append((tail, pc.end, pc.step))
        self._fn(
            ctypes.c_void_p(master.data_ptr()), ctypes.c_void_p(exp_avg.data_ptr()),
            ctypes.c_void_p(exp_avg_sq.data_ptr()), ctypes.c_void_p(grad.data_ptr()),
            arr, ctypes.c_int64(len(pieces)), ctypes.byref(_c_hyper(hyper)), ctypes.c_int(self.flags),
            ctypes.c_int(threads or torch.get_num_threads()),
        )
        if tails:  # torch's scalar loop, on the very elements (addresses) it would have run it on
            adam_kernel(
                [master[a:b] for a, b, _ in tails], [grad[a:b].float() for a, b, _ in tails],
                [exp_avg[a:b] for a, b, _ in tails], [exp_avg_sq[a:b] for a, b, _ in tails],
                [st for _, _, st in tails], hyper,
            )


_lock = threading.Lock()
_loaded: NativeAdam | None = None
_reason: str | None = None
_tried = False


def kernel() -> NativeAdam | None:
    """The checked kernel, built on first call; None where it cannot be had (see :func:`unavailable_reason`)."""
    global _loaded, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _load()
            except _Unavailable as e:
                _reason = str(e)
                if not e.asked:
                    warnings.warn(
                        f"megatrain_lightning: the one-pass host AdamW kernel is unavailable ({e}). Training is "
                        "the same bit for bit, but slower: bf16_grads defaults to off, and a compact-state "
                        "update takes ~4x longer. A C compiler on PATH (or $CC) fixes it; "
                        "MEGATRAIN_NATIVE_ADAM=0 silences this.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        return _loaded


def unavailable_reason() -> str | None:
    kernel()
    return _reason


def reset() -> None:
    """Forget the loaded kernel (tests; an environment change)."""
    global _loaded, _reason, _tried
    with _lock:
        _loaded, _reason, _tried = None, None, False


class _Unavailable(RuntimeError):
    def __init__(self, reason: str, asked: bool = False) -> None:
        super().__init__(reason)
        self.asked = asked  # turned off on purpose: no warning


def _load() -> NativeAdam:
    if os.environ.get("MEGATRAIN_NATIVE_ADAM", "1") == "0":
        raise _Unavailable("turned off by MEGATRAIN_NATIVE_ADAM=0", asked=True)
    if platform.system() != "Linux":
        raise _Unavailable(f"built on Linux only, this is {platform.system()}")
    path = _build()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise _Unavailable(f"could not load {path}: {e}") from e
    fn = lib.megatrain_adam_bf16_grad
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.POINTER(_CPiece), ctypes.c_int64, ctypes.POINTER(_CHyper),
                                           ctypes.c_int, ctypes.c_int]
    compact_fn = lib.megatrain_adam_compact
    compact_fn.restype = None
    compact_fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.POINTER(_CSpan), ctypes.c_int64, ctypes.POINTER(_CHyper),
                                                   ctypes.c_int, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 3
    widths = (16, 8) if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else (8, 16)
    for width in widths:
        for flags in _VARIANTS:
            candidate = NativeAdam(fn, flags, width, compact_fn)
            if _matches_torch(candidate):
                candidate.compact = _compact_matches(candidate)
                if not candidate.compact:
                    warnings.warn("megatrain_lightning: the one-pass compact-state AdamW does not reproduce the "
                                  "chunked one on this machine: compact-state updates take the chunked path "
                                  "(the same result, ~4x slower)", RuntimeWarning, stacklevel=3)
                return candidate
    raise _Unavailable("no compiled variant reproduces this torch build's fused AdamW bit for bit")


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(lines) + platform.machine()


def _build() -> Path:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise _Unavailable(f"no C compiler ({cc!r} not found; set CC)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *CFLAGS]).encode() + _cpu_key().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MEGATRAIN_CACHE") or Path.home() / ".cache" / "megatrain_lightning")
    path = cache / f"native_adam-{key}.so"
    if path.exists():
        return path
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
    except OSError as e:
        raise _Unavailable(f"cache directory {cache} not writable ({e}); set MEGATRAIN_CACHE") from e
    try:
        proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise _Unavailable(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, path)  # atomic: a concurrent user sees no library or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _matches_torch(k: NativeAdam) -> bool:
    """Bit for bit torch's fused kernel on the widened gradients, over the cases where spellings differ."""
    g = torch.Generator().manual_seed(0)
    sizes = [37, 16, 1000, 3, 8, 64 + 15, 24]  # every tail length class, pieces starting at odd offsets
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n + 5  # gaps, as alignment padding leaves: untouched
    total = pos
    cases = [
        AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True, False),
        AdamHyper(3e-3, 0.9, 0.99, 1e-6, 0.05, False, False),
        AdamHyper(1e-2, 0.3, 0.999, 1e-8, 0.0, True, True),  # 1 - beta1 >= 0.5: lerp's other branch
        AdamHyper(1e-3, 0.8, 0.95, 1e-8, 0.0, False, False),
    ]
    for hyper in cases:
        for step in (1.0, 7.0):
            p = torch.randn(total, generator=g)
            m = torch.randn(total, generator=g) * 0.1
            v = torch.rand(total, generator=g) * 0.01
            grad = torch.randn(total, generator=g).to(torch.bfloat16)
            ref = [t.clone() for t in (p, m, v)]
            steps = [torch.tensor(step) for _ in sizes]
            views = [[t[o : o + n] for o, n in zip(offsets, sizes)] for t in ref]
            g32 = grad.float()
            adam_kernel(views[0], [g32[o : o + n] for o, n in zip(offsets, sizes)], views[1], views[2], steps, hyper)
            pieces = [Piece(o, o + n, grad[o : o + n], st) for o, n, st in zip(offsets, sizes, steps)]
            k.step(p, m, v, grad, pieces, hyper, threads=2)
            if not all(torch.equal(a, b) for a, b in zip((p, m, v), ref)):
                return False
    return True


def _compact_matches(k: NativeAdam) -> bool:
    """Bit for bit ``compact.step_compact_chunked`` (torch ops), with and without the low half, fp32 and
    bf16 gradients, Adam and AdamW, several spans with gaps and tails."""

    g = torch.Generator().manual_seed(1)
    sizes = [37, 1000, 16, 64 + 9, 3]
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n + 11
    cases = [
        AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, True, False),
        AdamHyper(3e-3, 0.9, 0.99, 1e-6, 0.05, False, True),
    ]
    for hyper in cases:
        for with_low in (True, False):
            for grad_dtype in (torch.float32, torch.bfloat16):
                w = torch.randn(pos, generator=g)
                hi = torch.empty(pos, dtype=torch.bfloat16)
                lo = torch.empty(pos, dtype=torch.int16)
                split_fp32(w.view(torch.int32).clone(), hi, lo, torch.empty(pos, dtype=torch.int32))
                m = (torch.randn(pos, generator=g) * 1e-2).to(torch.bfloat16)
                v = (torch.rand(pos, generator=g) * 1e-4).to(torch.bfloat16)
                grad = (torch.randn(pos, generator=g) * 1e-2).to(grad_dtype)
                state = [hi, lo if with_low else None, m, v]
                ref = [t.clone() if t is not None else None for t in state]

                def spans(step: float) -> list[Piece]:
                    st = torch.tensor(step)
                    return [Piece(o, o + n, grad[o : o + n], st) for o, n in zip(offsets, sizes)]

                step_compact_chunked(*ref, spans(3.0), hyper)
                tails = k.compact_step(*state, spans(3.0), hyper, dither_table(16), threads=2)
                step_compact_chunked(*state, tails, hyper)
                if not all(a is None or torch.equal(a, b) for a, b in zip(state, ref)):
                    return False
    return True
