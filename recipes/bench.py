# python recipes/bench.py --run "experiment=bench_3b hardware=auto" --run "experiment=bench_7b hardware=auto"
"""Throughput runs through train.py, one process each, their rows appended to recipes/results/.

Each ``--run`` is one ``python train.py`` command line of Hydra overrides (the benchmark settings live in
``conf/experiment/bench_*.yaml``). The row written to ``<out>.csv`` / ``<out>.md`` holds the date, the
machine (``$MACHINE``, GPU, versions), the exact command, the measured step time, tokens/s, model TFLOPS
and MFU (``ThroughputMonitor``: mean over the steps after the first two, timed between two synchronised
points), peak GPU memory reserved, peak host RSS and the planner's prediction. Exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ["date", "machine", "command", "model", "params", "strategy", "micro_batch", "seq_len", "step_s",
           "predicted_step_s", "tokens_per_s", "tflops", "mfu", "peak_gpu_mem_gib", "peak_host_rss_gib", "status"]


def run(overrides: list[str], out_dir: Path, timeout: int) -> dict:
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={out_dir}"]
    t0 = time.time()
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "output.log"  # what the run printed (callbacks' reports included), written as it runs
    with log.open("w") as f:  # its own process group: a timeout kills inductor's compile workers too, and what
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True)
        timed_out = False
        try:  # the run printed up to then stays in output.log
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, timed_out = -1, True
    lines = log.read_text(errors="replace").strip().splitlines()
    tail = [f"timed out after {timeout} s"] if timed_out else lines[-1:] or ["?"]
    row: dict = {"date": str(datetime.date.today()), "command": "python train.py " + shlex.join(overrides)}
    for name in ("run_info.json", "metrics.json"):
        if (out_dir / name).is_file():
            row.update(json.loads((out_dir / name).read_text()))
    row["status"] = "ok" if rc == 0 else f"error (exit {rc}): {tail[0][:300]}"
    print(f"{row['command']}: {row['status']} in {time.time() - t0:.0f} s; step {row.get('step_s')} s "
          f"(planned {row.get('predicted_step_s')}), {row.get('tflops')} TFLOPS; placement {row.get('placement')}", flush=True)
    if rc != 0:
        print("\n".join(lines[-40:])[-3000:], file=sys.stderr)
    return row


def append(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out.with_suffix(".csv"), out.with_suffix(".md")
    new = not csv_path.exists()
    with csv_path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    with md_path.open("a") as f:
        f.write("\n| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in COLUMNS) + " |\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help="train.py overrides of one run (repeatable)")
    ap.add_argument("--out", default=f"recipes/results/{datetime.date.today()}-h200-throughput")
    ap.add_argument("--timeout", type=int, default=560, help="seconds per run")
    args = ap.parse_args()
    rows = []
    for i, line in enumerate(args.run):
        rows.append(run(shlex.split(line), ROOT / "outputs" / "bench" / f"{datetime.datetime.now():%H%M%S}-{i}", args.timeout))
    append(rows, ROOT / args.out)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
