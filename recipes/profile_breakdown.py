# python recipes/profile_breakdown.py TRACE.json --steps 3
"""Measured per-step time breakdown from a torch.profiler Chrome trace of a few training steps on a GPU.

Inside a fit, add the callback; it profiles optimizer steps ``first_step .. first_step + steps - 1``,
writes the trace into ``out_dir``, prints the breakdown to stderr and hands the figures to ``on_result``::

    from profile_breakdown import StepProfiler          # recipes/ on sys.path, or load the file
    prof = StepProfiler(first_step=5, steps=3, out_dir="outputs/profile", host_busy="megatrain", on_result=print)
    trainer = pl.Trainer(..., callbacks=[prof])

``host_busy="megatrain"`` reads the strategy's host optimizers (``megatrain_host_seconds``); any callable
returning cumulative host optimizer seconds does too. From ``train.py``:
``+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler ... +trainer.callbacks.profile.host_busy=megatrain``.

On a saved trace, from the shell (``--window T0 T1`` in trace microseconds, ``--host-busy`` seconds)::

    python recipes/profile_breakdown.py outputs/profile/trace_steps_5-7.json --steps 3

or from Python: ``print(format_breakdown(summarize_trace("trace.json", steps=3)))``.

What is measured (all figures in seconds per step, totals over the window divided by ``steps``):

* ``wall_s``: the window's length (default: first GPU event's start to the last GPU event's end).
* ``compute_busy_s``: union of kernels and memsets on the compute stream, the (device, stream) that
  runs the most kernel time in the window.
* ``h2d_busy_s`` / ``d2h_busy_s``: union of host-to-device / device-to-host memcpys, any stream.
* ``other_stream_kernels_s``: union of kernels on every other stream (e.g. dtype casts on copy streams).
* ``gpu_idle_s``: wall minus the union of all kernels and memsets on any stream; copies alone do not
  count as busy. ``compute_idle_s``: wall minus ``compute_busy_s``.
* ``host_optimizer_busy_s``: the caller's host optimizer seconds over the window / steps (only when given).
* ``*_frac``: each busy or idle figure as a fraction of ``wall_s``.

Every interval is clipped to the window; "union" merges overlapping intervals, so two streams busy at
the same time count once. Device-to-device and peer copies are not reported.

The callback does nothing on a machine without CUDA (no profiler, no files, no ``on_result`` call), so
it can stay in a configuration that also runs on the CPU. It sets ``megatrain_reads_weights = False``:
it never reads model parameters between steps.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

import torch
from lightning.pytorch.callbacks import Callback

Interval = tuple[float, float]
Kind = Literal["kernel", "memset", "h2d", "d2h", "memcpy"]  # "memcpy": any other direction (DtoD, PtoP, HtoH)
StreamKey = tuple[str, int]  # (device, stream)

_KERNEL_CATS = {"kernel"}
_MEMCPY_CATS = {"gpu_memcpy", "memcpy"}
_MEMSET_CATS = {"gpu_memset", "memset"}


# ---------------------------------------------------------------------------------------------
# reading the trace
# ---------------------------------------------------------------------------------------------
def load_trace(trace: dict | str | Path) -> dict:
    """The trace as a dict: passed through, or read from a ``.json`` / ``.json.gz`` path."""
    if isinstance(trace, dict):
        return trace
    path = Path(trace)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _complete_events(trace: dict) -> Iterable[dict]:
    """Events with a start and a duration ("ph": "X")."""
    for ev in trace.get("traceEvents", []):
        if isinstance(ev, dict) and ev.get("ph") == "X" and "ts" in ev and "dur" in ev:
            yield ev


def _gpu_kind(ev: dict) -> Kind | None:
    """What a complete event is on the GPU timeline, or None for host-side and annotation events."""
    cat = str(ev.get("cat", "")).lower()
    name = str(ev.get("name", ""))
    args = ev.get("args") or {}
    if cat in _KERNEL_CATS:
        return "kernel"
    if cat in _MEMSET_CATS:
        return "memset"
    # Memcpys by category, or by their name where the category is spelled otherwise; host-side runtime
    # calls ("cudaMemcpyAsync") carry no stream and do not start with "Memcpy".
    is_memcpy = cat in _MEMCPY_CATS or (name.startswith("Memcpy") and "stream" in args)
    if is_memcpy:
        lname = name.lower()
        return "h2d" if "htod" in lname else "d2h" if "dtoh" in lname else "memcpy"
    if name.startswith("Memset") and "stream" in args:
        return "memset"
    return None


def _stream(ev: dict) -> StreamKey:
    args = ev.get("args") or {}
    return (str(args.get("device", ev.get("pid", ""))), int(args.get("stream", ev.get("tid", -1))))


def _interval(ev: dict) -> Interval:
    ts = float(ev["ts"])
    return ts, ts + float(ev["dur"])


def trace_span(trace: dict | str | Path, gpu_only: bool = True) -> Interval:
    """(start, end) in trace microseconds of the GPU events, or of every complete event (CPU too)."""
    trace = load_trace(trace)
    spans = [_interval(ev) for ev in _complete_events(trace) if not gpu_only or _gpu_kind(ev)]
    if not spans:
        raise ValueError("the trace holds no GPU events" if gpu_only else "the trace holds no complete events")
    return min(s for s, _ in spans), max(e for _, e in spans)


# ---------------------------------------------------------------------------------------------
# interval arithmetic
# ---------------------------------------------------------------------------------------------
def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The parts of ``intervals`` inside ``window``; empty parts dropped."""
    t0, t1 = window
    out = []
    for s, e in intervals:
        s, e = max(s, t0), min(e, t1)
        if e > s:
            out.append((s, e))
    return out


def union_length(intervals: Iterable[Interval]) -> float:
    """Total length covered by ``intervals``, overlaps counted once."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


# ---------------------------------------------------------------------------------------------
# the breakdown
# ---------------------------------------------------------------------------------------------
def summarize_trace(trace: dict | str | Path, steps: int, window: Interval | None = None,
                    host_busy_s: float | None = None) -> dict[str, float]:
    """Per-step time breakdown of a Chrome trace (see the module docstring for each figure).

    trace: the dict written by ``torch.profiler.profile(...).export_chrome_trace(path)``, or that path.
    steps: how many optimizer steps the window covers; every figure is divided by it.
    window: (t0, t1) in trace microseconds; default: first GPU event's start to last GPU event's end.
    host_busy_s: host optimizer seconds measured by the caller over the window (total, not per step).
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    trace = load_trace(trace)
    if window is None:
        window = trace_span(trace, gpu_only=True)
    t0, t1 = float(window[0]), float(window[1])
    if t1 < t0:
        raise ValueError(f"window ends before it starts: {window}")

    by_kind: dict[Kind, list[tuple[StreamKey, Interval]]] = defaultdict(list)
    for ev in _complete_events(trace):
        kind = _gpu_kind(ev)
        if kind is None:
            continue
        for iv in clip([_interval(ev)], (t0, t1)):
            by_kind[kind].append((_stream(ev), iv))

    kernel_time: dict[StreamKey, float] = defaultdict(float)
    for stream, (s, e) in by_kind["kernel"]:
        kernel_time[stream] += e - s
    compute = max(kernel_time, key=kernel_time.__getitem__) if kernel_time else None

    def on(kinds: tuple[Kind, ...], keep: Callable[[StreamKey], bool] = lambda _: True) -> float:
        return union_length(iv for k in kinds for stream, iv in by_kind[k] if keep(stream))

    wall_us = t1 - t0
    compute_us = on(("kernel", "memset"), lambda st: st == compute)
    busy_us = {
        "compute_busy": compute_us,
        "h2d_busy": on(("h2d",)),
        "d2h_busy": on(("d2h",)),
        "other_stream_kernels": on(("kernel",), lambda st: st != compute),
        "gpu_idle": wall_us - on(("kernel", "memset")),
        "compute_idle": wall_us - compute_us,
    }

    per_step = 1e-6 / steps  # microseconds in total -> seconds per step
    wall_s = wall_us * per_step
    out: dict[str, float] = {"wall_s": wall_s}
    for name, us in busy_us.items():
        out[f"{name}_s"] = us * per_step
    if host_busy_s is not None:
        out["host_optimizer_busy_s"] = host_busy_s / steps
    for name in [k[:-2] for k in out if k != "wall_s"]:
        out[f"{name}_frac"] = out[f"{name}_s"] / wall_s if wall_s > 0 else 0.0
    return out


def top_kernels(trace: dict | str | Path, steps: int, n: int = 12, window: Interval | None = None
                ) -> list[tuple[str, float, float]]:
    """The ``n`` kernels (by name) that take the most time on the compute stream: ``(name, seconds per
    step, launches per step)``, costliest first; what to look at when ``compute_busy_s`` is higher than the
    work should take."""
    trace = load_trace(trace)
    if window is None:
        window = trace_span(trace, gpu_only=True)
    events = [(ev, _stream(ev)) for ev in _complete_events(trace) if _gpu_kind(ev) == "kernel"]
    compute = _compute_stream(events)
    time_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev, stream in events:
        if stream != compute:
            continue
        for s, e in clip([_interval(ev)], window):
            time_us[ev["name"]] += e - s
            count[ev["name"]] += 1
    ranked = sorted(time_us, key=time_us.__getitem__, reverse=True)[:n]
    return [(name, time_us[name] * 1e-6 / steps, count[name] / steps) for name in ranked]


def _compute_stream(events: list[tuple[dict, StreamKey]]) -> StreamKey | None:
    per_stream: dict[StreamKey, float] = defaultdict(float)
    for ev, stream in events:
        per_stream[stream] += float(ev["dur"])
    return max(per_stream, key=per_stream.__getitem__) if per_stream else None


def top_ops(trace: dict | str | Path, steps: int, n: int = 12, window: Interval | None = None
            ) -> list[tuple[str, float, float]]:
    """Compute-stream kernel time by the operator that launched it: ``(op, seconds per step, kernels per
    step)``, costliest first. ``op`` is the launching ``cpu_op``'s name with its input dims and types when
    the trace was recorded with ``record_shapes=True`` (``aten::mul [[16, 2048, 3584], [3584]] float,float``);
    kernels are matched to it by their ``External id``. Names the tensors behind an elementwise kernel."""
    trace = load_trace(trace)
    if window is None:
        window = trace_span(trace, gpu_only=True)
    launcher: dict[Any, str] = {}
    for ev in _complete_events(trace):
        args = ev.get("args") or {}
        if str(ev.get("cat", "")).lower() == "cpu_op" and "External id" in args:
            dims, types = args.get("Input Dims"), args.get("Input type")
            label = ev["name"]
            if dims:
                label += f" {json.dumps([d for d in dims if d], separators=(',', ':'))}"
            if types:
                label += " " + ",".join(t for t in types if t)
            launcher[args["External id"]] = label
    events = [(ev, _stream(ev)) for ev in _complete_events(trace) if _gpu_kind(ev) == "kernel"]
    compute = _compute_stream(events)
    time_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev, stream in events:
        if stream != compute:
            continue
        op = launcher.get((ev.get("args") or {}).get("External id"), "(no launching op)")
        for s, e in clip([_interval(ev)], window):
            time_us[op] += e - s
            count[op] += 1
    ranked = sorted(time_us, key=time_us.__getitem__, reverse=True)[:n]
    return [(op, time_us[op] * 1e-6 / steps, count[op] / steps) for op in ranked]


def compute_gaps(trace: dict | str | Path, n: int = 10, window: Interval | None = None
                 ) -> list[tuple[float, float, str, str]]:
    """The ``n`` longest stretches with no kernel on the compute stream: ``(start, length, kernel before,
    kernel after)``, start in seconds from the window's start, longest first. Where in the step the GPU
    waits (on a weight copy, an update, the host) and between which kernels."""
    trace = load_trace(trace)
    if window is None:
        window = trace_span(trace, gpu_only=True)
    events = [(ev, _stream(ev)) for ev in _complete_events(trace) if _gpu_kind(ev) == "kernel"]
    compute = _compute_stream(events)
    busy = sorted((s, e, ev["name"]) for ev, st in events if st == compute
                  for s, e in clip([_interval(ev)], window))
    t0, t1 = float(window[0]), float(window[1])
    gaps: list[tuple[float, float, str, str]] = []
    edge, before = t0, "(window start)"
    for s, e, name in busy:
        if s > edge:
            gaps.append(((edge - t0) * 1e-6, (s - edge) * 1e-6, before, name))
        if e >= edge:
            edge, before = e, name
    if t1 > edge:
        gaps.append(((edge - t0) * 1e-6, (t1 - edge) * 1e-6, before, "(window end)"))
    return sorted(gaps, key=lambda g: g[1], reverse=True)[:n]


def format_breakdown(d: dict[str, float]) -> str:
    """One line: step time, then each figure in seconds per step with its share of the step."""

    def part(label: str, key: str) -> str:
        return f"{label} {d[f'{key}_s']:.3f} s ({100 * d[f'{key}_frac']:.0f}%)"

    parts = [part("compute busy", "compute_busy"), part("GPU idle", "gpu_idle"), part("h2d", "h2d_busy"),
             part("d2h", "d2h_busy"), part("other-stream kernels", "other_stream_kernels")]
    if "host_optimizer_busy_s" in d:
        parts.append(part("host optimizer", "host_optimizer_busy"))
    line = f"step {d['wall_s']:.3f} s: " + ", ".join(parts)
    if "host_wall_s" in d:
        line += f" [host clock {d['host_wall_s']:.3f} s/step]"
    return line


def print_details(trace: dict | str | Path, steps: int, top: int, ops: int, gaps: int,
                  window: Interval | None, out: Any) -> None:
    """The kernel, operator and gap lists below the breakdown line (each only when its count > 0)."""
    trace = load_trace(trace)
    for name, sec, launches in top_kernels(trace, steps, top, window) if top else ():
        print(f"  {1e3 * sec:9.1f} ms/step {launches:6.0f}x  {name[:150]}", file=out)
    for op, sec, launches in top_ops(trace, steps, ops, window) if ops else ():
        print(f"  op {1e3 * sec:9.1f} ms/step {launches:6.0f}x  {op[:200]}", file=out)
    for start, length, before, after in compute_gaps(trace, gaps, window) if gaps else ():
        print(f"  gap {1e3 * length:8.2f} ms at +{1e3 * start:9.2f} ms  after {before[:70]}  before {after[:70]}",
              file=out)


# ---------------------------------------------------------------------------------------------
# the callback
def megatrain_host_seconds(trainer: Any) -> float:
    """Cumulative host seconds in the optimizer updates of a fit under ``strategy="megatrain"``: the sum of
    its host optimizers' ``update_seconds`` (overlapped updates on the host worker and ``step()``'s)."""
    hosts = getattr(getattr(getattr(trainer, "strategy", None), "precision_plugin", None), "host_optimizers", None)
    if hosts is None:
        raise ValueError(
            f"StepProfiler(host_busy='megatrain') reads MegaTrainStrategy's host optimizers; this fit runs "
            f"{type(getattr(trainer, 'strategy', None)).__name__}. Pass a callable returning cumulative host "
            "optimizer seconds, or leave host_busy at None.")
    return float(sum(h.update_seconds for h in hosts.values()))


# ---------------------------------------------------------------------------------------------
class StepProfiler(Callback):
    """Profiles optimizer steps ``first_step .. first_step + steps - 1`` (0-based) of a fit on CUDA.

    Starts at the first step boundary where ``trainer.global_step >= first_step``: the ``on_train_batch_end``
    where an optimizer step just raised ``global_step`` to ``first_step``, or ``on_train_batch_start`` of the
    fit's first batch when the fit begins there (``first_step=0``, or a resumed fit already past it). With
    gradient accumulation the window therefore holds whole optimizer steps. Stops at the
    ``on_train_batch_end`` where ``global_step`` reaches ``first_step + steps``; a fit that ends earlier
    stops it in ``on_train_end`` with the steps done. Both ends call ``torch.cuda.synchronize()``.

    The trace goes to ``out_dir/trace_steps_{first}-{last}.json``; it is summarized over its whole span,
    first to last event of any kind (CPU too: host-only gaps at the window's edges count as GPU idle).
    ``host_busy``, if given, returns cumulative host optimizer seconds (``"megatrain"``: the strategy's, see
    :func:`megatrain_host_seconds`; an update still running on into the next forward counts where it ends); the
    difference over the window is reported as ``host_optimizer_busy_s``. The result also carries ``host_wall_s``:
    the window measured with ``time.perf_counter``, per step. Without CUDA every hook returns at once.
    """

    megatrain_reads_weights = False

    def __init__(self, first_step: int, steps: int, out_dir: str, on_result: Callable[[dict], None] | None = None,
                 host_busy: Callable[[], float] | Literal["megatrain"] | None = None, top: int = 0, ops: int = 0,
                 gaps: int = 0) -> None:
        if first_step < 0 or steps <= 0:
            raise ValueError(f"need first_step >= 0 and steps > 0, got {first_step}, {steps}")
        if isinstance(host_busy, str) and host_busy != "megatrain":
            raise ValueError(f"host_busy: a callable, 'megatrain' or None, got {host_busy!r}")
        self.first_step, self.steps, self.out_dir = first_step, steps, Path(out_dir)
        self.on_result, self.host_busy, self.top, self.ops, self.gaps = on_result, host_busy, top, ops, gaps
        self.enabled = torch.cuda.is_available()
        self.result: dict[str, float] | None = None
        self.trace_path: Path | None = None
        self._state: Literal["waiting", "running", "done"] = "waiting"
        self._last_step: int | None = None  # global_step seen at the last hook
        self._profiler: Any = None
        self._start_step = 0
        self._t_start = 0.0
        self._host_start = 0.0
        self._trainer: Any = None  # the fit's, for host_busy="megatrain"

    # hooks -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self.enabled or self._last_step is not None:
            return
        self._trainer = trainer
        self._last_step = trainer.global_step  # the fit's first batch: a step boundary
        self._at_boundary(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.enabled or trainer.global_step == self._last_step:
            return
        self._trainer = trainer
        self._last_step = trainer.global_step  # an optimizer step just finished
        self._at_boundary(trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.enabled and self._state == "running":
            self._stop(trainer.global_step)

    # ----------------------------------------------------------------------------------------
    def _host_seconds(self) -> float | None:
        if self.host_busy is None:
            return None
        if self.host_busy == "megatrain":
            return megatrain_host_seconds(self._trainer)
        return self.host_busy()

    def _at_boundary(self, step: int) -> None:
        if self._state == "waiting" and step >= self.first_step:
            self._start(step)
        elif self._state == "running" and step >= self._start_step + self.steps:
            self._stop(step)

    def _start(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=self.ops > 0)
        self._profiler.start()
        self._start_step, self._state = step, "running"
        self._host_start = self._host_seconds() or 0.0
        self._t_start = time.perf_counter()

    def _stop(self, step: int) -> None:
        torch.cuda.synchronize()
        host_wall = time.perf_counter() - self._t_start
        now = self._host_seconds()
        host_busy = None if now is None else now - self._host_start
        self._profiler.stop()
        profiler, self._profiler, self._state = self._profiler, None, "done"
        done = step - self._start_step
        if done <= 0:  # the fit ended before a profiled step finished
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.out_dir / f"trace_steps_{self._start_step}-{step - 1}.json"
        profiler.export_chrome_trace(str(self.trace_path))
        trace = load_trace(self.trace_path)
        result = summarize_trace(trace, done, window=trace_span(trace, gpu_only=False), host_busy_s=host_busy)
        result["host_wall_s"] = host_wall / done
        self.result = result
        print(f"[profile steps {self._start_step}-{step - 1}] {format_breakdown(result)}", file=sys.stderr)
        print_details(trace, done, self.top, self.ops, self.gaps, trace_span(trace, gpu_only=False), sys.stderr)
        if self.on_result is not None:
            self.on_result(result)


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description="Per-step time breakdown of a torch.profiler Chrome trace.")
    p.add_argument("trace", type=Path, help="the .json (or .json.gz) written by export_chrome_trace")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps the trace covers")
    p.add_argument("--window", type=float, nargs=2, metavar=("T0", "T1"), help="trace microseconds")
    p.add_argument("--all-events", action="store_true", help="window: first to last event of any kind")
    p.add_argument("--host-busy", type=float, help="host optimizer seconds over the window")
    p.add_argument("--top", type=int, default=0, help="also list the N costliest compute-stream kernels")
    p.add_argument("--ops", type=int, default=0, help="... the N operators whose kernels cost the most")
    p.add_argument("--gaps", type=int, default=0, help="... the N longest compute-stream gaps")
    a = p.parse_args(argv)
    window = tuple(a.window) if a.window else (trace_span(a.trace, gpu_only=False) if a.all_events else None)
    result = summarize_trace(a.trace, a.steps, window=window, host_busy_s=a.host_busy)
    print(format_breakdown(result))
    print_details(a.trace, a.steps, a.top, a.ops, a.gaps, window, sys.stdout)
    return result


if __name__ == "__main__":
    main()
