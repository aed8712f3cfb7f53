"""recipes/profile_breakdown.py on synthetic Chrome traces with known answers (CPU only)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import load_recipe

pb = load_recipe("profile_breakdown")
US = 1e-6


def gpu(name: str, ts: float, end: float, stream: int, cat: str = "kernel", device: int = 0) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream, "ts": ts, "dur": end - ts,
            "args": {"device": device, "stream": stream, "correlation": 1}}


def host(name: str, ts: float, end: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": end - ts, "args": {}}


def base_events(kernel_cat: str = "kernel", memcpy_cat: str = "gpu_memcpy") -> list[dict]:
    """Compute stream 7: kernels [0,100], [150,300]; stream 20: h2d [50,200] and a cast kernel [200,220];
    stream 21: d2h [250,400]."""
    return [
        gpu("ampere_gemm", 0, 100, 7, kernel_cat),
        gpu("flash_fwd", 150, 300, 7, kernel_cat),
        gpu("Memcpy HtoD (Pinned -> Device)", 50, 200, 20, memcpy_cat),
        gpu("elementwise_cast_bf16", 200, 220, 20, kernel_cat),
        gpu("Memcpy DtoH (Device -> Pinned)", 250, 400, 21, memcpy_cat),
    ]


def trace(events: list[dict]) -> dict:
    # metadata and host-side events the summary must ignore
    extra = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
             host("aten::mm", -50, 500),
             host("cudaMemcpyAsync", 40, 60, cat="cuda_runtime"),
             {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "ts": 0, "pid": 0, "tid": 7}]
    return {"schemaVersion": 1, "traceEvents": extra + events}


FULL = {  # microseconds, whole trace, window (0, 400)
    "wall_s": 400, "compute_busy_s": 250, "h2d_busy_s": 150, "d2h_busy_s": 150, "other_stream_kernels_s": 20,
    "gpu_idle_s": 150, "compute_idle_s": 150,
}


def check(got: dict[str, float], want_us: dict[str, float], steps: int) -> None:
    for key, us in want_us.items():
        assert got[key] == pytest.approx(us * US / steps, abs=1e-12), key
    wall = want_us["wall_s"]
    for key, us in want_us.items():
        if key != "wall_s":
            assert got[key[:-2] + "_frac"] == pytest.approx(us / wall), key


@pytest.mark.parametrize("steps", [1, 2])
def test_known_breakdown_over_the_gpu_span(steps: int) -> None:
    got = pb.summarize_trace(trace(base_events()), steps=steps)
    check(got, FULL, steps)
    assert "host_optimizer_busy_s" not in got
    assert set(got) == set(FULL) | {k[:-2] + "_frac" for k in FULL if k != "wall_s"}


def test_window_clips_every_interval() -> None:
    got = pb.summarize_trace(trace(base_events()), steps=1, window=(50, 250))
    # compute [50,100] + [150,250]; h2d [50,200]; d2h [250,250] empty; cast [200,220] inside compute's [150,250]
    check(got, {"wall_s": 200, "compute_busy_s": 150, "h2d_busy_s": 150, "d2h_busy_s": 0,
                "other_stream_kernels_s": 20, "gpu_idle_s": 50, "compute_idle_s": 50}, 1)


def test_window_wider_than_the_events_counts_as_idle() -> None:
    got = pb.summarize_trace(trace(base_events()), steps=4, window=(-100, 500))
    check(got, {**FULL, "wall_s": 600, "gpu_idle_s": 350, "compute_idle_s": 350}, 4)


def test_capitalised_and_unusual_categories() -> None:
    events = base_events(kernel_cat="Kernel", memcpy_cat="Memcpy")
    events[4]["cat"] = "gpu_op"  # known only by its name and its stream
    check(pb.summarize_trace(trace(events), steps=2), FULL, 2)


def test_annotations_and_runtime_calls_are_not_gpu_work() -> None:
    events = base_events() + [
        gpu("ProfilerStep#3", 0, 400, 7, cat="gpu_user_annotation"),
        host("Memcpy HtoD lookalike without a stream", 0, 400, cat="user_annotation"),
        host("cudaLaunchKernel", 0, 400, cat="cuda_runtime"),
    ]
    check(pb.summarize_trace(trace(events), steps=1), FULL, 1)


def test_unions_overlaps_across_streams_and_counts_memsets() -> None:
    events = [
        # stream 3 has more kernels, stream 5 more kernel time: stream 5 is the compute stream
        gpu("k", 0, 10, 3), gpu("k", 20, 30, 3), gpu("k", 40, 50, 3),
        gpu("big", 0, 60, 5),
        gpu("Memset (Device)", 60, 70, 5, cat="gpu_memset"),  # compute stream: compute busy
        gpu("Memset (Device)", 90, 100, 3, cat="Gpu_Memset"),  # other stream: GPU busy, not a kernel
        # two HtoD copies overlapping each other on two streams, one DtoD copy (not reported)
        gpu("Memcpy HtoD (Pageable -> Device)", 0, 50, 8, cat="gpu_memcpy"),
        gpu("Memcpy HtoD (Pinned -> Device)", 30, 80, 9, cat="gpu_memcpy"),
        gpu("Memcpy DtoD (Device -> Device)", 100, 120, 8, cat="gpu_memcpy"),
    ]
    got = pb.summarize_trace(trace(events), steps=1)
    check(got, {"wall_s": 120, "compute_busy_s": 70, "h2d_busy_s": 80, "d2h_busy_s": 0,
                "other_stream_kernels_s": 30, "gpu_idle_s": 120 - 80, "compute_idle_s": 50}, 1)


def test_same_stream_number_on_two_devices_are_two_streams() -> None:
    events = [gpu("k", 0, 60, 7, device=0), gpu("k", 40, 100, 7, device=1), gpu("k", 100, 110, 7, device=0)]
    got = pb.summarize_trace(trace(events), steps=1)
    assert got["compute_busy_s"] == pytest.approx(70 * US)  # device 0: 60 + 10 us of kernels
    assert got["other_stream_kernels_s"] == pytest.approx(60 * US)
    assert got["gpu_idle_s"] == pytest.approx(0.0)


def test_host_optimizer_time_is_passed_through_per_step() -> None:
    got = pb.summarize_trace(trace(base_events()), steps=2, host_busy_s=300 * US)
    assert got["host_optimizer_busy_s"] == pytest.approx(150 * US)
    assert got["host_optimizer_busy_frac"] == pytest.approx(0.75)


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_path_input(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    with (gzip.open if name.endswith(".gz") else open)(path, "wt") as f:
        json.dump(trace(base_events()), f)
    check(pb.summarize_trace(path, steps=2), FULL, 2)
    check(pb.summarize_trace(str(path), steps=2), FULL, 2)


def test_trace_span() -> None:
    t = trace(base_events())
    assert pb.trace_span(t) == (0, 400)
    assert pb.trace_span(t, gpu_only=False) == (-50, 500)
    with pytest.raises(ValueError):
        pb.trace_span({"traceEvents": [host("aten::mm", 0, 1)]})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        pb.summarize_trace(trace(base_events()), steps=0)
    with pytest.raises(ValueError):
        pb.summarize_trace(trace(base_events()), steps=1, window=(10, 5))


def test_format_breakdown() -> None:
    d = pb.summarize_trace(trace(base_events()), steps=1, window=(0, 500), host_busy_s=100 * US)
    d = {k: v * 1e4 if k.endswith("_s") else v for k, v in d.items()}  # 500 us -> 5 s
    line = pb.format_breakdown(d)
    assert line == ("step 5.000 s: compute busy 2.500 s (50%), GPU idle 2.500 s (50%), h2d 1.500 s (30%), "
                    "d2h 1.500 s (30%), other-stream kernels 0.200 s (4%), host optimizer 1.000 s (20%)")
    assert pb.format_breakdown({**d, "host_wall_s": 5.25}).endswith(" [host clock 5.250 s/step]")


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace(base_events())))
    got = pb.main([str(path), "--steps", "2", "--window", "50", "250"])
    assert got["wall_s"] == pytest.approx(100 * US)
    assert capsys.readouterr().out.startswith("step 0.000 s: compute busy")
    assert pb.main([str(path), "--steps", "1", "--all-events"])["wall_s"] == pytest.approx(550 * US)


# ---------------------------------------------------------------------------------------------
# the callback
# ---------------------------------------------------------------------------------------------
def drive(cb, global_steps: list[int], end: bool = True) -> None:
    """Calls the hooks the way a fit does; ``global_steps[b]`` is trainer.global_step after batch b."""
    trainer = SimpleNamespace(global_step=0)
    for b, step_after in enumerate(global_steps):
        cb.on_train_batch_start(trainer, None, None, b)
        trainer.global_step = step_after
        cb.on_train_batch_end(trainer, None, None, None, b)
    if end:
        cb.on_train_end(trainer, None)


def test_step_profiler_is_a_no_op_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def forbidden(*args, **kwargs):
        raise AssertionError("touched CUDA or the profiler without CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.profiler, "profile", forbidden)
    results: list[dict] = []
    out = tmp_path / "profile"
    cb = pb.StepProfiler(first_step=1, steps=2, out_dir=str(out), on_result=results.append, host_busy=forbidden)
    assert pb.StepProfiler.megatrain_reads_weights is False
    drive(cb, [1, 2, 3, 4, 5])
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert results == [] and cb.result is None and cb.trace_path is None


class FakeProfile:
    """Stands in for torch.profiler.profile; logs start/stop against the driver's batch counter."""

    log: list[str] = []

    def __init__(self, activities, record_shapes: bool) -> None:
        assert len(activities) == 2 and record_shapes is False  # shapes only when ops are listed

    def start(self) -> None:
        FakeProfile.log.append("start")

    def stop(self) -> None:
        FakeProfile.log.append("stop")

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(json.dumps(trace(base_events())))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: FakeProfile.log.append("sync"))
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    FakeProfile.log = []
    return FakeProfile.log


def test_step_profiler_window_with_gradient_accumulation(tmp_path: Path, fake_cuda: list[str]) -> None:
    busy = iter([10.0, 10.5])  # cumulative host optimizer seconds at start and at stop
    results: list[dict] = []
    cb = pb.StepProfiler(first_step=2, steps=2, out_dir=str(tmp_path / "p"), on_result=results.append,
                         host_busy=lambda: next(busy))
    # accumulate 2: global_step after batch b is (b + 1) // 2; starts after batch 3, stops after batch 7
    accumulate = [(b + 1) // 2 for b in range(12)]
    trainer = SimpleNamespace(global_step=0)
    for b, step_after in enumerate(accumulate):
        cb.on_train_batch_start(trainer, None, None, b)
        trainer.global_step = step_after
        cb.on_train_batch_end(trainer, None, None, None, b)
        fake_cuda.append(f"b{b}")
    cb.on_train_end(trainer, None)
    assert " ".join(fake_cuda) == "b0 b1 b2 sync start b3 b4 b5 b6 sync stop b7 b8 b9 b10 b11"
    assert cb.trace_path == tmp_path / "p" / "trace_steps_2-3.json" and cb.trace_path.exists()
    assert results == [cb.result]
    # whole-trace window: first to last event of any kind, (-50, 500) us; 2 steps
    assert cb.result["wall_s"] == pytest.approx(550 * US / 2)
    assert cb.result["compute_busy_s"] == pytest.approx(250 * US / 2)
    assert cb.result["host_optimizer_busy_s"] == pytest.approx(0.25)
    assert cb.result["host_wall_s"] >= 0


def test_step_profiler_from_the_first_batch_and_a_short_fit(tmp_path: Path, fake_cuda: list[str]) -> None:
    results: list[dict] = []
    cb = pb.StepProfiler(first_step=0, steps=5, out_dir=str(tmp_path), on_result=results.append)
    drive(cb, [1, 2, 3])  # the fit ends after 3 of the 5 steps: summarized over 3
    assert fake_cuda == ["sync", "start", "sync", "stop"]
    assert cb.trace_path == tmp_path / "trace_steps_0-2.json"
    assert results[0]["wall_s"] == pytest.approx(550 * US / 3)
    assert "host_optimizer_busy_s" not in results[0]


def test_step_profiler_stopped_before_a_step_writes_nothing(tmp_path: Path, fake_cuda: list[str]) -> None:
    results: list[dict] = []
    cb = pb.StepProfiler(first_step=2, steps=3, out_dir=str(tmp_path / "p"), on_result=results.append)
    drive(cb, [1, 2])
    assert fake_cuda == ["sync", "start", "sync", "stop"]
    assert results == [] and not (tmp_path / "p").exists()


def test_top_kernels_ranks_the_compute_stream_only() -> None:
    events = base_events() + [gpu("ampere_gemm", 300, 380, 7), gpu("elementwise_cast_bf16", 380, 390, 7)]
    got = pb.top_kernels(trace(events), steps=2, n=2)
    # stream 7: gemm 100 + 80, flash 150, cast 10 (the cast on stream 20 is not the compute stream's)
    assert [name for name, _, _ in got] == ["ampere_gemm", "flash_fwd"]
    assert got[0][1] == pytest.approx(180 * US / 2) and got[0][2] == 1.0
    assert got[1][1] == pytest.approx(150 * US / 2) and got[1][2] == 0.5
    clipped = pb.top_kernels(trace(events), steps=1, n=5, window=(0, 50))
    assert clipped == [("ampere_gemm", pytest.approx(50 * US), 1.0)]


def op(name: str, ts: float, end: float, ext: int, dims: list | None = None, types: list | None = None) -> dict:
    ev = host(name, ts, end)
    ev["args"] = {"External id": ext, **({"Input Dims": dims} if dims else {}), **({"Input type": types} if types else {})}
    return ev


def launched(ev: dict, ext: int) -> dict:
    ev["args"]["External id"] = ext
    return ev


def test_top_ops_names_the_launching_operator_with_its_shapes() -> None:
    events = [
        op("aten::mm", 0, 10, 1, [[8, 4], [4, 2]], ["c10::BFloat16", "c10::BFloat16"]),
        op("aten::mul", 10, 20, 2, [[8, 4], [4], []], ["float", "float", ""]),
        op("aten::mul", 20, 30, 3, [[8, 4], [4], []], ["float", "float", ""]),
        launched(gpu("nvjet_gemm", 0, 100, 7), 1),
        launched(gpu("elementwise_mul", 150, 200, 7), 2),
        launched(gpu("elementwise_mul", 200, 230, 7), 3),
        launched(gpu("elementwise_mul", 0, 50, 9), 3),  # another stream's kernel: not counted
        gpu("orphan_kernel", 240, 250, 7),
        gpu("nvjet_gemm", 260, 900, 11),  # stream 11 runs the most kernel time: it is the compute stream
    ]
    got = pb.top_ops(trace(events), steps=1, n=5)
    assert got == [("(no launching op)", pytest.approx(640 * US), 1.0)]
    events[-1] = gpu("small", 260, 270, 11)
    got = pb.top_ops(trace(events), steps=2, n=5)
    assert got[0] == ("aten::mm [[8,4],[4,2]] c10::BFloat16,c10::BFloat16", pytest.approx(50 * US), 0.5)
    # both muls have the same shapes and types: one row, two kernels; the empty dims and type are dropped
    assert got[1] == ("aten::mul [[8,4],[4]] float,float", pytest.approx(40 * US), 1.0)
    assert got[2] == ("(no launching op)", pytest.approx(5 * US), 0.5)
    assert len(got) == 3


def test_compute_gaps_longest_first_with_their_neighbours() -> None:
    events = [gpu("a", 10, 100, 7), gpu("b", 50, 120, 7), gpu("c", 300, 310, 7), gpu("d", 340, 400, 7),
              gpu("copy_cast", 150, 290, 8)]  # another stream's kernel does not fill the compute stream's gap
    got = pb.compute_gaps(trace(events), n=3, window=(0, 450))
    assert got == [(pytest.approx(120 * US), pytest.approx(180 * US), "b", "c"),
                   (pytest.approx(400 * US), pytest.approx(50 * US), "d", "(window end)"),
                   (pytest.approx(310 * US), pytest.approx(30 * US), "c", "d")]
    assert pb.compute_gaps(trace(events), n=10, window=(0, 450))[-1] == (0.0, pytest.approx(10 * US),
                                                                          "(window start)", "a")


def test_command_line_lists_ops_and_gaps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [op("aten::add_", 0, 5, 4, [[3]], ["float"]), launched(gpu("add_kernel", 0, 100, 7), 4),
              gpu("gemm", 160, 300, 7)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace(events)))
    pb.main([str(path), "--steps", "1", "--ops", "2", "--gaps", "1"])
    out = capsys.readouterr().out.splitlines()
    assert "op" in out[1] and "(no launching op)" in out[1] and "0.1 ms/step" in out[1]
    assert "aten::add_ [[3]] float" in out[2] and "0.1 ms/step" in out[2]
    assert out[3].startswith("  gap     0.06 ms at +     0.10 ms  after add_kernel  before gemm")


def test_step_profiler_reads_the_strategys_host_optimizers(tmp_path: Path, fake_cuda: list[str]) -> None:
    """host_busy="megatrain": the sum of the strategy's host optimizers' update seconds over the window."""
    hosts = {1: SimpleNamespace(update_seconds=0.0), 2: SimpleNamespace(update_seconds=0.0)}
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(precision_plugin=SimpleNamespace(
        host_optimizers=hosts)))
    cb = pb.StepProfiler(first_step=1, steps=2, out_dir=str(tmp_path), host_busy="megatrain")
    for b in range(4):  # one optimizer step per batch; each step's updates take 0.5 + 0.25 s
        cb.on_train_batch_start(trainer, None, None, b)
        hosts[1].update_seconds += 0.5
        hosts[2].update_seconds += 0.25
        trainer.global_step = b + 1
        cb.on_train_batch_end(trainer, None, None, None, b)
    assert fake_cuda == ["sync", "start", "sync", "stop"]
    assert cb.result["host_optimizer_busy_s"] == pytest.approx(0.75)  # steps 1-2: 1.5 s over 2 steps


def test_step_profiler_megatrain_host_busy_needs_the_strategy(tmp_path: Path, fake_cuda: list[str]) -> None:
    with pytest.raises(ValueError, match="callable, 'megatrain' or None"):
        pb.StepProfiler(first_step=0, steps=1, out_dir=str(tmp_path), host_busy="deepspeed")
    cb = pb.StepProfiler(first_step=0, steps=1, out_dir=str(tmp_path), host_busy="megatrain")
    other = SimpleNamespace(global_step=0, strategy=SimpleNamespace(precision_plugin=SimpleNamespace()))
    with pytest.raises(ValueError, match="reads MegaTrainStrategy's host optimizers; this fit runs SimpleNamespace"):
        cb.on_train_batch_start(other, None, None, 0)


@pytest.mark.parametrize("clip", [None, 0.5], ids=["overlapped", "in step"])
def test_megatrain_host_seconds_counts_every_host_update(clip: float | None) -> None:
    """A real fit: the host optimizer's seconds grow whether the stores update as their gradients land
    (overlapped, on the host worker) or in ``step()`` (clipping needs every gradient first)."""
    import lightning as L
    from test_streaming import HooklessNet, _loader, _trainer

    class Read(L.Callback):  # at the fit's end, while the strategy still holds its host optimizers
        def on_train_end(self, trainer, module) -> None:
            (host,) = trainer.strategy.precision_plugin.host_optimizers.values()
            self.early, self.seconds = host.early_updates, host.update_seconds
            self.read = pb.megatrain_host_seconds(trainer)

    read = Read()
    _trainer("megatrain", max_steps=2, gradient_clip_val=clip, callbacks=[read]).fit(HooklessNet(depth=3), _loader())
    assert (read.early > 0) == (clip is None)  # which path ran
    assert read.seconds > 0 and read.read == read.seconds
    default = _trainer("auto", max_steps=1)
    default.fit(HooklessNet(depth=3), _loader())
    with pytest.raises(ValueError, match="this fit runs SingleDeviceStrategy"):
        pb.megatrain_host_seconds(default)
