"""`python train.py` as a user runs it: in a subprocess, from a scratch directory, offline.

The default run must learn the embedded task; a multirun must survive a failing run and tabulate
both; bad input must end in one clear line and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ADDRESS_SPACE_LIMIT = 16 * 1024**3  # bad input runs get this much virtual memory: refusal must come first

TRAIN = Path(__file__).resolve().parent.parent / "train.py"


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, str(TRAIN), *args]


@pytest.mark.slow
def test_default_run_learns_arithmetic_in_under_two_minutes(tmp_path: Path) -> None:
    started = time.perf_counter()
    proc = subprocess.run(train_cmd(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics_file,) = tmp_path.glob("outputs/*/*/metrics.json")  # Hydra's run directory
    metrics = json.loads(metrics_file.read_text())
    print(f"default run: {wall:.1f} s wall, exact match {metrics['exact_match_start']:.3f} -> {metrics['exact_match']:.3f}")
    assert metrics["strategy"] == "megatrain" and metrics["model"] == "tiny" and metrics["steps"] > 0
    assert metrics["exact_match"] >= 0.30
    assert metrics["exact_match"] > metrics["exact_match_start"]
    shown = proc.stdout + proc.stderr
    for field in ("loss", "tokens/s", "TFLOPS"):  # on the progress bar
        assert field in shown, field
    assert (metrics_file.parent / "logs" / "metrics.csv").is_file()  # the CSV logger's per-step log
    assert wall < 120, f"the default run took {wall:.0f} s (budget: 2 minutes on 2 cores)"


@pytest.mark.slow
def test_multirun_tabulates_every_run_including_a_failed_one(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        train_cmd(
            "-m", "hardware=cpu", "hardware.host_memory_gb=32,1e-6",  # the second cannot fit: it fails
            "trainer.max_steps=4", "trainer.val_check_interval=4", "data.num_val=16",
            f"hydra.sweep.dir={sweep_dir}",
        ),
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(sweep_dir / "sweep_results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1"]
    ok, failed = rows
    assert ok["status"] == "ok" and ok["model"] == "tiny" and ok["strategy"] == "megatrain"
    assert float(ok["tokens_per_s"]) > 0 and int(ok["params"]) == 558080 and ok["micro_batch"] == "64"
    assert failed["status"].startswith("error: ") and "host memory" in failed["status"]
    assert int(failed["params"]) == 558080  # known from run_info.json, written before the check
    table = (sweep_dir / "sweep_results.md").read_text().splitlines()
    assert len(table) == 4 and "tokens/s" in table[0] and "| ok |" in table[2] and "error: " in table[3]
    assert (sweep_dir / "0" / "metrics.json").is_file() and not (sweep_dir / "1" / "metrics.json").exists()


# name → (overrides, fragments the one-line message must contain)
BAD_INPUT = {
    "unknown model": (["model=llama_9000"], ["Could not find 'model/llama_9000'", "qwen2_5_7b", "gpt_oss_120b", "tiny"]),
    "unknown hardware": (["hardware=tpu_v9"], ["Could not find 'hardware/tpu_v9'", "h200", "rtx3090", "auto"]),
    "missing jsonl file": (
        ["data=jsonl", "data.path=/nonexistent/train.jsonl"],
        ["error: data.path=/nonexistent/train.jsonl does not exist"],
    ),
    "missing text dir": (["data=text", "data.path=/nonexistent/corpus"], ["error: data.path=/nonexistent/corpus does not exist"]),
    "unset data path": (["data=jsonl"], ["error: data.path must be set"]),
    "missing checkpoint": (
        ["model.pretrained=/nonexistent/checkpoint"],
        ["error: model.pretrained=/nonexistent/checkpoint does not exist"],
    ),
    "too big for host memory": (
        ["model=qwen2_5_72b", "hardware=cpu"],
        ["error: model=qwen2_5_72b (72.71 B parameters) needs", "899.5 GB of host memory", "hardware=cpu has 32 GB"],
    ),
}
if not torch.cuda.is_available():
    BAD_INPUT["GPU-only baseline on a CPU"] = (
        ["strategy=fsdp_cpu_offload", "hardware=cpu"], ["error: strategy=fsdp_cpu_offload runs only on CUDA GPUs"]
    )
if importlib.util.find_spec("deepspeed") is None:
    BAD_INPUT["deepspeed not installed"] = (
        ["strategy=deepspeed_zero3_offload"], ["error: strategy=deepspeed_zero3_offload needs the deepspeed package"]
    )


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """All bad-input runs at once: each is mostly interpreter start-up, so they overlap well."""
    cwd = tmp_path_factory.mktemp("bad_input")
    started = time.perf_counter()
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))

    procs = {
        name: subprocess.Popen(
            train_cmd(*args), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit_memory
        )
        for name, (args, _) in BAD_INPUT.items()
    }
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        results[name] = (subprocess.CompletedProcess(p.args, p.returncode, out, err), time.perf_counter() - started)
    return results


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gives_one_clear_message_and_nonzero_exit(case: str, bad_input_runs: dict) -> None:
    proc, _ = bad_input_runs[case]
    shown = proc.stdout + proc.stderr
    assert proc.returncode != 0, shown[-2000:]
    assert "Traceback" not in shown, shown[-4000:]
    for fragment in BAD_INPUT[case][1]:
        assert fragment in shown, f"{fragment!r} not in:\n{shown[-2000:]}"


def test_too_big_model_is_refused_before_allocation(bad_input_runs: dict) -> None:
    """72.7 B parameters are 290 GB in fp32; the run had 16 GiB of address space and still refused
    with the fit check's message (not a MemoryError), so it allocated nothing of the model."""
    proc, elapsed = bad_input_runs["too big for host memory"]
    assert proc.returncode == 2 and "MemoryError" not in proc.stderr
    assert elapsed < 120
