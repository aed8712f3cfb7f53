"""Sweep isolation: a child that dies, however it dies, becomes a row; rows become one table."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatrain_lightning.sweep import SweepTable, classify, run_child, write_table

TRAIN = Path(__file__).resolve().parent.parent / "train.py"


def test_a_child_killed_by_the_oom_killer_is_an_out_of_memory_row(tmp_path: Path) -> None:
    # What the kernel's OOM killer does: SIGKILL, no exception, no output, no chance to clean up.
    suicide = "import os, signal, json; open('run_info.json','w').write(json.dumps({'model': 'm', 'params': 7})); os.kill(os.getpid(), signal.SIGKILL)"
    job = tmp_path / "0"
    job.mkdir()
    row = run_child([sys.executable, "-c", f"import os; os.chdir({str(job)!r}); {suicide}"], job, job=0)
    assert row["status"].startswith("out of memory: killed by SIGKILL")
    assert row["returncode"] == -9 and row["model"] == "m" and row["params"] == 7
    assert json.loads((job / "sweep_row.json").read_text()) == row


def test_a_crashing_child_is_an_error_row_with_its_exception_line(tmp_path: Path) -> None:
    row = run_child([sys.executable, "-c", "print('training...'); raise RuntimeError('shapes do not match')"], tmp_path / "1", job=1)
    assert row["status"] == "error: RuntimeError: shapes do not match" and row["returncode"] == 1
    assert "training..." in (tmp_path / "1" / "output.log").read_text()


def test_reasons_are_one_line_and_recognise_device_oom() -> None:
    assert classify(0, "anything") == ("ok", "")
    assert classify(2, "lots of log\nerror: model=x has 7.62 B parameters\n") == ("error", "model=x has 7.62 B parameters")
    cuda = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert classify(1, cuda) == ("out of memory", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert classify(137, "") [0] == "out of memory"
    assert classify(-15, "step 3\r")[1] == "killed by signal SIGTERM: step 3"


def test_the_reason_of_a_crash_under_hydra_is_its_exception_line() -> None:
    """Hydra wraps a job's traceback in "Error executing job with overrides: [...]" and a hint; the reason is
    the exception's own line even when its class is not called ...Error (it was Hydra's wrapper line)."""
    hydra = ("Error executing job with overrides: ['a=1']\nTraceback (most recent call last):\n  File \"x.py\", "
             "line 3, in main\n    compile()\ntorch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n"
             "  RuntimeError: boom\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n")
    assert classify(1, hydra) == ("error", "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:")
    plain = "Error executing job with overrides: []\nTraceback (most recent call last):\n  File x\nmy.Stop: halted\n\nSet the..."
    assert classify(1, plain) == ("error", "my.Stop: halted")
    assert classify(1, "Traceback (most recent call last):\n  File x\nKeyboardInterrupt\n") == ("error", "KeyboardInterrupt")


def test_table_has_one_row_per_job_in_job_order(tmp_path: Path) -> None:
    for job, row in [(10, {"status": "ok", "tokens_per_s": 1234.5, "mfu": 0.4}), (2, {"status": "error: boom | bang"})]:
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "sweep_row.json").write_text(json.dumps({"job": job, "model": "m", "params": 7.6e9, **row}))
    rows = write_table(tmp_path)
    assert [r["job"] for r in rows] == [2, 10]
    with open(tmp_path / "sweep_results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["error: boom | bang", "ok"]
    md = (tmp_path / "sweep_results.md").read_text().splitlines()
    assert md[0].startswith("| job | model | params (B) | strategy |") and len(md) == 4
    assert "| 7.600 |" in md[3] and "| 1,234 |" in md[3] and "| 40.0% |" in md[3]
    assert md[2].count("|") == md[0].count("|")  # a '|' inside a reason does not add a column


def _end_sweep(sweep_dir: Path, statuses: list[str]) -> None:
    """SweepTable's end of a multirun over jobs of these statuses."""
    for job, status in enumerate(statuses):
        (sweep_dir / str(job)).mkdir()
        (sweep_dir / str(job) / "sweep_row.json").write_text(json.dumps({"job": job, "status": status}))
    SweepTable().on_multirun_end(config=OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}}))


def test_a_sweep_with_some_runs_failed_ends_normally_and_counts_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="megatrain_lightning.sweep"):
        _end_sweep(tmp_path, ["ok", "error: boom", "out of memory: killed by SIGKILL"])
    (last,) = [r for r in caplog.records if r.getMessage().startswith("sweep: ")]
    assert last.levelno == logging.WARNING
    assert last.getMessage().startswith("sweep: 1 of 3 runs ok, 2 failed (the status column says why")
    assert f"table in {tmp_path / 'sweep_results.md'}" in last.getMessage()


def test_a_sweep_none_of_whose_runs_succeeded_exits_1(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        _end_sweep(tmp_path, ["error: boom"])
    assert stop.value.code == 1 and (tmp_path / "sweep_results.md").is_file()


@pytest.mark.slow
def test_a_real_multirun_whose_every_run_is_refused_exits_1_with_the_reason_in_its_table(tmp_path: Path) -> None:
    """`python train.py -m ...` whose runs all fail (here one run, refused: it cannot fit) exits 1 after its
    table and its one-line summary (it exited 0, as if the sweep had worked); the status says why, no traceback."""
    sweep_dir = tmp_path / "sweep"
    (tmp_path / "user_callback.py").write_text(  # a user's own Hydra callback: it still runs at the multirun's end
        "from pathlib import Path\nfrom hydra.experimental.callback import Callback\n\n"
        "class Done(Callback):\n    def on_multirun_end(self, config, **kwargs):\n"
        "        Path('user_callback_ran').write_text('yes')\n")
    proc = subprocess.run([sys.executable, str(TRAIN), "-m", "hardware=cpu", "hardware.host_memory_gb=1e-6",
                           f"hydra.sweep.dir={sweep_dir}", "+hydra.callbacks.mine._target_=user_callback.Done"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    shown = proc.stdout + proc.stderr
    assert proc.returncode == 1, shown[-4000:]
    assert (tmp_path / "user_callback_ran").read_text() == "yes"  # Hydra ends callbacks in reverse: it ran first
    assert "sweep: 0 of 1 runs ok, 1 failed (the status column says why" in shown
    assert f"table in {sweep_dir / 'sweep_results.md'}" in shown and "Traceback" not in shown
    (refusal,) = [ln for ln in (sweep_dir / "0" / "output.log").read_text().splitlines() if ln.startswith("error: ")]
    assert "host memory" in refusal
    (row,) = (sweep_dir / "sweep_results.md").read_text().splitlines()[2:]
    assert f"| {refusal} |" in row  # the whole reason, in the status column


def test_a_reused_sweep_directory_counts_only_this_sweeps_rows(tmp_path: Path) -> None:
    """An earlier sweep's rows in the same hydra.sweep.dir (its job 1 ok) neither enter this sweep's table nor hide
    that every run of this one failed (found 2026-12-07: the sweep exited 0)."""
    for job, status in ((0, "error: old"), (1, "ok")):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "sweep_row.json").write_text(json.dumps({"job": job, "status": status}))
        os.utime(tmp_path / str(job) / "sweep_row.json", (time.time() - 3600,) * 2)
    table = SweepTable()
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    table.on_multirun_start(config=config)
    (tmp_path / "0" / "sweep_row.json").write_text(json.dumps({"job": 0, "status": "error: boom"}))  # this sweep's job
    with pytest.raises(SystemExit) as stop:
        table.on_multirun_end(config=config)
    assert stop.value.code == 1
    assert len((tmp_path / "sweep_results.md").read_text().splitlines()) == 3  # header, rule, this sweep's one job
