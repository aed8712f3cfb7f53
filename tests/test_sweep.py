"""Sweep isolation: a child that dies, however it dies, becomes a row; rows become one table."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from megatrain_lightning.sweep import classify, run_child, write_table


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
