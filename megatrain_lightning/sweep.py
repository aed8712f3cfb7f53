"""Multirun sweeps: every run in a child process of its own, one results table at the end.

Why a process per run: a model that does not fit is often not refused politely but killed by the
kernel's out-of-memory killer (SIGKILL, no exception, no cleanup), and a run sharing the sweep's
process would take the sweep down with it. So under `python train.py -m ...` Hydra's ordinary
launcher calls `run_job` for each combination, which re-executes the same script with that job's
overrides as a plain single run in the job's directory and waits for it. The child writes
`run_info.json` before training and `metrics.json` after; the parent adds the exit status and a
one-line reason as `sweep_row.json` and never raises, so the sweep always reaches its end, where
`SweepTable` (a Hydra callback) gathers the rows into `sweep_results.csv` and `sweep_results.md`, and
draws the runs' curves side by side in `sweep_curves.png` (with matplotlib). A sweep none of whose runs
succeeded then exits with code 1 (a script or CI job running it sees the failure); one with some runs ok
exits 0 and its last log line counts the failed ones.
Cost: each run pays Python and library start-up again (seconds), negligible beside a training run.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

ROW_FILE = "sweep_row.json"
OUTPUT_FILE = "output.log"

# (key in a row, column title, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("job", "job", "{}"),
    ("model", "model", "{}"),
    ("params", "params (B)", "{:.3f}"),
    ("strategy", "strategy", "{}"),
    ("hardware", "hardware", "{}"),
    ("micro_batch", "micro-batch", "{}"),
    ("seq_len", "seq len", "{}"),
    ("step_s", "s/step", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("tflops", "TFLOPS", "{:.2f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("peak_gpu_mem_gib", "peak GPU mem (GiB)", "{:.2f}"),
    ("peak_host_rss_gib", "peak host RSS (GiB)", "{:.2f}"),
    ("exact_match", "exact match", "{:.1%}"),
    ("status", "status", "{}"),
    ("machine", "machine", "{}"),
)

_OOM = re.compile(r"out of memory|OutOfMemoryError|can't allocate memory|MemoryError", re.IGNORECASE)


def classify(returncode: int, output: str) -> tuple[str, str]:
    """(status, one-line reason) of a finished child from its exit code and output."""
    if returncode == 0:
        return "ok", ""
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return "out of memory", "killed by SIGKILL (most likely the kernel's out-of-memory killer)"
    raw = [ln.rstrip() for ln in re.split(r"[\r\n]+", output) if ln.strip()]
    lines = [ln.strip() for ln in raw]
    # Prefer train.py's own one-line error, then the last traceback's exception line (the first unindented
    # line after its frames: Hydra follows it with a hint, and precedes it with "Error executing job ..."),
    # then an exception-like line, then whatever came last.
    reason = next((ln for ln in reversed(lines) if ln.startswith("error:")), None)
    tracebacks = [i for i, ln in enumerate(raw) if ln.startswith("Traceback (most recent call last)")]
    if tracebacks and not reason:
        reason = next((ln for ln in raw[tracebacks[-1] + 1:] if not ln[0].isspace()), None)
    reason = reason or next((ln for ln in reversed(lines) if re.match(r"^[\w.]*(Error|Exception)\b", ln)), None)
    reason = reason or (lines[-1] if lines else "")
    reason = reason.removeprefix("error:").strip()
    if returncode < 0:
        reason = f"killed by signal {signal.Signals(-returncode).name}" + (f": {reason}" if reason else "")
    if _OOM.search(reason):
        return "out of memory", reason
    return "error", reason or f"exit code {returncode}"


def run_child(cmd: list[str], job_dir: Path, job: int | str = "", overrides: str = "") -> dict[str, Any]:
    """Run one job's command with output to `job_dir/output.log`; returns and writes its row (`overrides`:
    the job's own, as the sweep's curves label it)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(job_dir / OUTPUT_FILE, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    output = (job_dir / OUTPUT_FILE).read_text(errors="replace")[-20000:]
    status, reason = classify(rc, output)
    row: dict[str, Any] = {"job": job, "overrides": overrides}
    for name in ("run_info.json", "metrics.json"):
        if (job_dir / name).is_file():
            row.update(json.loads((job_dir / name).read_text()))
    row.update(status=status if status == "ok" else f"{status}: {reason}", returncode=rc,
               wall_s=round(time.perf_counter() - started, 1))
    (job_dir / ROW_FILE).write_text(json.dumps(row, indent=2, default=str) + "\n")
    return row


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """One multirun job, delegated to a child `train.py` run in this job's directory. Never raises."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    cmd = [sys.executable, sys.argv[0], f"--config-name={hc.job.config_name}"]
    cmd += [f"--config-dir={s.path}" for s in hc.runtime.config_sources if s.provider == "command-line"]
    cmd += list(hc.overrides.task)
    cmd += [f"hydra.run.dir='{job_dir}'", "hydra.output_subdir=null"]  # the parent already saved .hydra/
    row = run_child(cmd, job_dir, job=hc.job.num, overrides=" ".join(hc.overrides.task))
    log.info("job %s (%s): %s in %.0f s", hc.job.num, " ".join(hc.overrides.task), row["status"], row["wall_s"])
    return row


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None or value == "":
        return "-"
    if key == "params":
        value = value / 1e9
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def write_table(sweep_dir: Path, since: float | None = None) -> list[dict[str, Any]]:
    """Collect every job's row under `sweep_dir` into `sweep_results.csv` and `sweep_results.md`; ``since`` (a
    time.time()): only rows written since then, so an earlier sweep's rows in a reused directory are not counted."""
    def job_number(p: Path) -> tuple[int, str]:
        name = p.parent.name
        return (int(name), name) if name.isdigit() else (1 << 30, name)

    found = sorted(sweep_dir.glob(f"*/{ROW_FILE}"), key=job_number)
    rows = [json.loads(p.read_text()) for p in found if since is None or p.stat().st_mtime >= since]
    with open(sweep_dir / "sweep_results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([key for key, _, _ in COLUMNS])
        writer.writerows([["" if r.get(key) is None else r.get(key) for key, _, _ in COLUMNS] for r in rows])
    lines = [
        "| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
        "|" + "|".join(" --- " for _ in COLUMNS) + "|",
    ]
    for r in rows:
        cells = [_cell(r, key, fmt).replace("|", "/") for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    (sweep_dir / "sweep_results.md").write_text("\n".join(lines) + "\n")
    return rows


class SweepTable(Callback):
    """Hydra callback: at the end of a multirun, writes the sweep's results table (CSV and Markdown) and
    its curves (PNG)."""

    def __init__(self) -> None:
        self.started: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time() - 1.0  # mtimes may be coarser than time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_table(sweep_dir, since=self.started)
        from megatrain_lightning.plot import plot_sweep

        png = plot_sweep(sweep_dir, rows)  # None (with a one-line note) without matplotlib
        if png is not None:
            log.info("sweep: curves in %s", png)
        ok = sum(1 for r in rows if r.get("status") == "ok")
        failed = len(rows) - ok
        table = sweep_dir / "sweep_results.md"
        if not failed:
            log.info("sweep: %d of %d runs ok; table in %s\n%s", ok, len(rows), table, table.read_text())
            return
        (log.warning if ok else log.error)(
            "sweep: %d of %d runs ok, %d failed (the status column says why, each run's output.log has the rest); "
            "table in %s\n%s", ok, len(rows), failed, table, table.read_text())
        if not ok:  # nothing succeeded: the sweep fails. Hydra's callback loop and its error report catch
            raise SystemExit(1)  # Exception only, so this ends the process with exit code 1, no traceback
