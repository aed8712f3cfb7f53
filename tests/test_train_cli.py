"""`python train.py` as a user runs it: in a subprocess, from a scratch directory, offline.

The default run must learn the embedded task; a multirun must survive a failing run and tabulate
both; bad input must end in one clear line and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import re
import signal
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


def _default_run(tmp_path: Path) -> tuple[str, Path, float]:
    """The default `python train.py`: its output, its run directory and its training time. Under `.ci/run`,
    which has just run the README's first line (install, then `python train.py` from the repository root)
    and names its log in $MEGATRAIN_README_RUN_LOG, that run is the one checked; else one is run here."""
    log = os.environ.get("MEGATRAIN_README_RUN_LOG")
    if log:
        shown = Path(log).read_text()
        found = re.findall(r"run directory: (\S+)", shown)
        assert found, f"{log}: the README's first line printed no run directory"
        run_dir = Path(found[-1])
        return shown, run_dir, json.loads((run_dir / "metrics.json").read_text())["duration_s"]
    started = time.perf_counter()
    proc = subprocess.run(train_cmd(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    (metrics_file,) = tmp_path.glob("outputs/*/*/metrics.json")  # Hydra's run directory
    shown = proc.stdout + proc.stderr
    assert f"run directory: {metrics_file.parent.resolve()}" in shown  # says where it all is
    return shown, metrics_file.parent, wall


@pytest.mark.slow
def test_default_run_learns_arithmetic_in_under_two_minutes(tmp_path: Path) -> None:
    shown, run_dir, wall = _default_run(tmp_path)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(f"default run: {wall:.1f} s, exact match {metrics['exact_match_start']:.3f} -> {metrics['exact_match']:.3f}")
    assert metrics["strategy"] == "megatrain" and metrics["model"] == "tiny" and metrics["steps"] > 0
    assert metrics["exact_match"] >= 0.30
    assert metrics["exact_match"] > metrics["exact_match_start"]
    for field in ("loss", "tokens/s", "TFLOPS"):  # on the progress bar
        assert field in shown, field
    assert (run_dir / "logs" / "metrics.csv").is_file()  # the CSV logger's per-step log
    for left in ("hf/config.json", "hf/model.safetensors", "checkpoints/last.ckpt", "checkpoints/best.ckpt", "curves.png"):
        assert (run_dir / left).is_file() and (run_dir / left).stat().st_size > 0, left
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
    assert float(ok["tokens_per_s"]) > 0 and int(ok["params"]) == 558080 and ok["micro_batch"] == "32"
    assert failed["status"].startswith("error: ") and "host memory" in failed["status"]
    assert int(failed["params"]) == 558080  # known from run_info.json, written before the check
    table = (sweep_dir / "sweep_results.md").read_text().splitlines()
    assert len(table) == 4 and "tokens/s" in table[0] and "| ok |" in table[2] and "error: " in table[3]
    assert (sweep_dir / "0" / "metrics.json").is_file() and not (sweep_dir / "1" / "metrics.json").exists()
    png = sweep_dir / "sweep_curves.png"  # the runs side by side
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


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
    "every unset key at once": (
        ["data=jsonl", "model=default"],
        ["error: data.path, model.name must be set", "model.config (random init) or model.pretrained="],
    ),
    "missing checkpoint": (
        ["model.pretrained=/nonexistent/checkpoint"],
        ["error: model.pretrained=/nonexistent/checkpoint does not exist"],
    ),
    "malformed jsonl line": (["data=jsonl", "data.path=bad.jsonl"], ["error: bad.jsonl:2: not valid JSON", "fix or remove that line"]),
    "unknown data format": (
        ["data=jsonl", "data.path=unknown.jsonl"],
        ["error: unknown.jsonl:1: a record with keys [question, answer] matches none of the data formats",
         "metamath (query, response", "alpaca (instruction, input, output)", "sharegpt", "data.query_key"],
    ),
    "zero batch size": (["data.batch_size=0"], ["error: data.batch_size=0: expected a positive integer"]),
    "special token outside a shrunk vocabulary": (
        ["model=gpt_oss_20b", "model.config.vocab_size=512"],
        ["error: model.config.pad_token_id=199999 is outside the vocabulary (model.config.vocab_size=512)",
         "Set model.config.pad_token_id below 512 (or null), or raise vocab_size"],
    ),
    "negative clipping": (["trainer.gradient_clip_val=-1"], ["error: trainer.gradient_clip_val=-1: expected a positive number"]),
    "max_steps not a number": (["trainer.max_steps=abc"], ["error: trainer.max_steps='abc': expected an integer", "trainer.max_steps=-1"]),
    "misspelt trainer key": (["+trainer.max_step=5"], ["error: trainer.max_step: Trainer has no parameter 'max_step'", "did you mean trainer.max_steps?"]),
    # found by a sweep of bad input (2026-12-05): an unknown top-level key was ignored (so was a resume), a seed
    # that is not a number ended in Lightning's traceback
    "misspelt top-level key": (["+ckpt_paht=last.ckpt"], ["error: ckpt_paht: train.py reads no top-level setting "
                                                           "'ckpt_paht' (did you mean ckpt_path?)"]),
    "missing resume checkpoint": (["ckpt_path=/nonexistent/last.ckpt"],
                                  ["error: ckpt_path=/nonexistent/last.ckpt does not exist", "checkpoints/last.ckpt"]),
    "seed not a number": (["seed=abc"], ["error: seed='abc': expected an integer"]),
    # found by a sweep of bad input (2026-12-06): a block class that matches nothing ended in a traceback; a file
    # given as model.pretrained was said not to exist
    "unknown block class": (["strategy.block_class=Foo"], ["error: block_class='Foo' matches no submodule"]),
    "pretrained is a file": (["model.pretrained=bad.jsonl"], ["error: model.pretrained=bad.jsonl is a file"]),
    "pick_micro_batch not a boolean": (["pick_micro_batch=maybe"], ["error: pick_micro_batch='maybe': expected true or false"]),
    # found by a sweep of bad input (2026-12-07): a misspelt model.config key was kept and ignored (32 layers for 2);
    # sizes the model cannot run with, a broken config.json, a zero in a hardware profile, an output directory that
    # cannot exist, a data vocabulary past the model's and a checkpoint that is not one ended in tracebacks after the
    # build; data without one batch trained nothing with exit 0; a misspelt monitor failed at the first validation
    "misspelt model config key": (["+model.config.num_hidden_layer=1"],
                                  ["error: model.config has keys that neither transformers' LlamaConfig nor the llama "
                                   "model reads: num_hidden_layer (did you mean num_hidden_layers?)"]),
    "zero hidden size": (["model.config.hidden_size=0"], ["error: model.config.hidden_size=0: a llama model needs it"]),
    "kv heads not dividing heads": (["model.config.num_key_value_heads=3"],
                                    ["error: model.config.num_key_value_heads=3 does not divide num_attention_heads=4"]),
    "unknown activation": (["+model.config.hidden_act=sliu"], ["error: model.config.hidden_act='sliu' is not an "
                                                              "activation transformers knows (did you mean silu?)"]),
    "broken pretrained config": (["model.pretrained=broken_ckpt"],
                                 ["error: model.pretrained=broken_ckpt: its config.json cannot be read by transformers"]),
    "zero link bandwidth": (["hardware=cpu", "hardware.link_gb_per_s=0"],
                            ["error: hardware.link_gb_per_s=0: expected a positive number"]),
    "zero devices": (["trainer.devices=0"], ["error: trainer.devices=0: expected a positive number of devices"]),
    "output directory cannot exist": (["paths.output_dir=bad.jsonl/run"],
                                      ["error: paths.output_dir=bad.jsonl/run cannot be created"]),
    "data vocabulary past the model's": (["data=synthetic", "data.vocab_size=1000", "hardware=cpu"],
                                         ["error: data.vocab_size=1000: token ids are drawn below it",
                                          "set data.vocab_size=259"]),
    "data without one batch": (["data=synthetic", "data.num_samples=3", "data.batch_size=4", "hardware=cpu"],
                               ["error: the training data gives no batch: 3 training samples, fewer than one batch of "
                                "data.batch_size=4", "(data.num_samples)"]),
    "misspelt checkpoint monitor": (["trainer.callbacks.checkpoint.monitor=val/los"],
                                    ["error: trainer.callbacks.checkpoint.monitor=val/los: the model logs no such metric "
                                     "(did you mean val/loss?"]),
    "NaN in pretrained weights": (["experiment=finetune_jsonl", "model.pretrained=nan_ckpt", "data.path=good.jsonl"],
                                  ["error: model.pretrained=nan_ckpt: model.layers.1.mlp.down_proj.weight holds 3 NaN",
                                   "Use an earlier or freshly downloaded copy"]),
    "device peak far over the device": (["hardware=cpu", "hardware.device_memory_gb=0.5", "data=synthetic",
                                         "data.batch_size=4096", "data.seq_len=64"],
                                        ["error: model=tiny at micro-batch 4096 x 64 tokens needs 6.2 GB of device memory "
                                         "but hardware=cpu has 0.5 GB for tensors: use at most data.batch_size=328"]),
    "hardware precision misspelt": (["hardware=cpu", "hardware.precision=16-foo"],
                                    ["error: hardware.precision='16-foo': expected one of Lightning's precisions"]),
    "zero max operand": (["data.max_operand=0"], ["error: data.max_operand=0: expected a positive integer"]),
    "jsonl path a directory": (["data=jsonl", "data.path=nan_ckpt"], ["error: data.path=nan_ckpt is a directory, not a "
                                                                      "file"]),
    "resume from a plain state dict": (["ckpt_path=weights.pt"],
                                       ["error: ckpt_path=weights.pt is not the checkpoint of a Lightning training run: "
                                        "it has no state_dict, optimizer_states, loops (its top-level keys: weight)",
                                        "model.pretrained="]),
    "resume from a file that is no checkpoint": (["ckpt_path=bad.jsonl"], ["bad.jsonl: not a torch checkpoint"]),
    "single device too big for a CPU host": (
        ["strategy=single_device", "model=qwen2_5_72b", "hardware=cpu"],
        ["error: model=qwen2_5_72b (72.71 B parameters) needs", "hardware=cpu has 32 GB"],
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
    BAD_INPUT["GPU profile without a GPU"] = (
        ["hardware=rtx3090"], ["error: hardware=rtx3090 is a CUDA GPU profile, but this machine has no CUDA GPU",
                               "python -m megatrain_lightning.plan hardware=rtx3090"]
    )
if importlib.util.find_spec("deepspeed") is None:
    BAD_INPUT["deepspeed not installed"] = (
        ["strategy=deepspeed_zero3_offload"], ["error: strategy=deepspeed_zero3_offload needs the deepspeed package"]
    )


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """All bad-input runs at once, each `python train.py ARGS` in a child forked after the imports they share
    (tests/forked_train.py: one interpreter start-up, not one per case; 65 s of the suite before)."""
    cwd = tmp_path_factory.mktemp("bad_input")
    (cwd / "bad.jsonl").write_text('{"query": "q", "response": "a"}\n{"query": "q2", "response": \n')
    (cwd / "unknown.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    (cwd / "broken_ckpt").mkdir()
    (cwd / "broken_ckpt" / "config.json").write_text('{"model_type": "llama", ')
    (cwd / "broken_ckpt" / "model.safetensors").write_bytes(b"")
    torch.save({"weight": torch.zeros(2)}, cwd / "weights.pt")
    from safetensors.torch import load_file, save_file

    from megatrain_lightning.models.demo_checkpoint import write_demo_checkpoint

    weights = write_demo_checkpoint(cwd / "nan_ckpt", hidden_size=32) / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.down_proj.weight"][0, :3] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    (cwd / "good.jsonl").write_text("".join(f'{{"query": "{a}+1?", "response": "{a + 1}"}}\n' for a in range(200)))
    names = sorted(BAD_INPUT)
    spec = {"cwd": str(cwd), "address_space": ADDRESS_SPACE_LIMIT,
            "cases": {f"case{i}": BAD_INPUT[name][0] for i, name in enumerate(names)}}
    (cwd / "cases.json").write_text(json.dumps(spec))
    started = time.perf_counter()
    runner = subprocess.Popen([sys.executable, str(Path(__file__).parent / "forked_train.py"), str(cwd / "cases.json")],
                              start_new_session=True)  # its forked cases share its process group
    try:
        assert runner.wait(timeout=300) == 0
    finally:
        if runner.poll() is None or any(not (cwd / f"case{i}.rc").exists() for i in range(len(names))):
            with contextlib.suppress(ProcessLookupError):  # no case left running past a failed or timed-out runner
                os.killpg(runner.pid, signal.SIGKILL)
    imported = time.perf_counter() - started - max(float((cwd / f"case{i}.s").read_text()) for i in range(len(names)))
    results = {}
    for i, name in enumerate(names):
        out, err, rc = ((cwd / f"case{i}.{x}").read_text() for x in ("out", "err", "rc"))
        elapsed = imported + float((cwd / f"case{i}.s").read_text())  # as if started alone: the imports, then the case
        results[name] = (subprocess.CompletedProcess(train_cmd(*BAD_INPUT[name][0]), int(rc), out, err), elapsed)
    return results


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gives_one_clear_message_and_nonzero_exit(case: str, bad_input_runs: dict) -> None:
    proc, _ = bad_input_runs[case]
    shown = proc.stdout + proc.stderr
    assert proc.returncode != 0, shown[-2000:]
    assert "Traceback" not in shown, shown[-4000:]
    for fragment in BAD_INPUT[case][1]:
        assert fragment in shown, f"{fragment!r} not in:\n{shown[-2000:]}"
    if not case.startswith("unknown ") or case == "unknown data format":  # Hydra's own: exit 1, its own words
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(errors) == 1, shown[-2000:]  # one paragraph, one line
        assert all(fragment in errors[0] for fragment in BAD_INPUT[case][1] if fragment.startswith("error: "))


def test_too_big_model_is_refused_before_allocation(bad_input_runs: dict) -> None:
    """72.7 B parameters are 290 GB in fp32; the run had 16 GiB of address space and still refused
    with the fit check's message (not a MemoryError), so it allocated nothing of the model."""
    proc, elapsed = bad_input_runs["too big for host memory"]
    assert proc.returncode == 2 and "MemoryError" not in proc.stderr
    assert elapsed < 120


def test_a_run_leaves_a_loadable_model_checkpoints_curves_and_says_where(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """What a fine-tuner takes away from a run: `hf/` that from_pretrained loads (the final weights), last and
    best checkpoints, per-step learning rate and validation loss, a loss curve, and the directory printed."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM

    from megatrain_lightning import cli

    out = tmp_path / "run"
    with initialize_config_dir(config_dir=str(TRAIN.parent / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True, overrides=[
            "hardware=cpu", "trainer.max_steps=25", "trainer.val_check_interval=10", "data.num_val=16",
            "trainer.log_every_n_steps=5", "trainer.callbacks.summary.last_n=10", f"paths.output_dir={out}"])
    metrics = cli.train(cfg)
    shown = capsys.readouterr().out
    assert f"run directory: {out.resolve()}" in shown and "from_pretrained" in shown

    # the export holds the final weights: those of last.ckpt, saved after step 25 (the last validation was at 20)
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 25 and metrics["steps"] == 25
    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    exported = model.state_dict()
    for key, value in state["state_dict"].items():
        assert torch.equal(exported[key.removeprefix("model.")], value), key
    assert (out / "checkpoints" / "best.ckpt").is_file() and metrics["best_checkpoint"].endswith("best.ckpt")
    assert torch.load(out / "checkpoints" / "best.ckpt", weights_only=False)["global_step"] in (10, 20)

    with open(out / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("lr-AdamW") for r in rows) and sum(1 for r in rows if r.get("val/loss")) == 3 + 1  # 0, 10, 20, 25
    png = out / "curves.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert metrics["curves_png"] == str(png.resolve()) and metrics["hf_dir"] == str((out / "hf").resolve())
    # metrics.json: the loss over the run, not the last batch, and the validation loss of the final weights
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["train_loss_mean_all_batches"] > saved["train_loss_mean_last_10_batches"] > 0
    assert "loss" not in saved and saved["val_loss"] > 0 and saved["exact_match"] is not None


def test_curves_without_matplotlib_are_a_one_line_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    import importlib.util as iu

    from megatrain_lightning import plot

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with caplog.at_level("INFO", logger="megatrain_lightning.plot"):
        assert plot.plot_run(tmp_path) is None and plot.plot_sweep(tmp_path, []) is None
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2 and all("matplotlib is not installed" in n and "\n" not in n for n in notes)


def test_sweep_curves_compare_the_runs(tmp_path: Path) -> None:
    from megatrain_lightning.plot import SWEEP_PNG, plot_sweep

    rows = []
    for job, (model, speed) in enumerate([("tiny", 900.0), ("qwen2_5_0_5b", 300.0), ("qwen2_5_7b", None)]):
        (tmp_path / str(job) / "logs").mkdir(parents=True)
        if speed is not None:  # the third run failed: no log, a zero bar
            lines = ["step,loss,val/exact_match"] + [f"{s},{3.0 / (1 + s + job)},{'' if s % 5 else s / 20}" for s in range(20)]
            (tmp_path / str(job) / "logs" / "metrics.csv").write_text("\n".join(lines) + "\n")
        rows.append({"job": job, "model": model, "strategy": "megatrain", "tokens_per_s": speed})
    png = plot_sweep(tmp_path, rows)
    assert png == tmp_path / SWEEP_PNG and png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


def test_without_validation_last_checkpoint_and_export_and_random_tokens_save_nothing(tmp_path: Path) -> None:
    """Continued pre-training on text (no validation): last.ckpt and hf/, no best.ckpt. Synthetic throughput
    data: neither (a 7B throughput run would write 120 GB of training state for random tokens)."""
    from hydra import compose, initialize_config_dir

    from megatrain_lightning import cli

    (tmp_path / "corpus.txt").write_text("hello world, this is some text. " * 200)
    runs = {}
    for name, data in (("text", ["data=text", f"data.path={tmp_path / 'corpus.txt'}"]), ("synthetic", ["data=synthetic"])):
        with initialize_config_dir(config_dir=str(TRAIN.parent / "conf"), version_base="1.3"):
            cfg = compose(config_name="train", return_hydra_config=True, overrides=[
                *data, "hardware=cpu", "data.seq_len=32", "trainer.max_steps=3", f"paths.output_dir={tmp_path / name}"])
        runs[name] = cli.train(cfg)
    text, synthetic = runs["text"], runs["synthetic"]
    assert text["exact_match"] is None and text["best_checkpoint"] is None and text["last_checkpoint"].endswith("last.ckpt")
    assert (tmp_path / "text" / "hf" / "model.safetensors").is_file()
    assert synthetic["hf_dir"] is None and synthetic["last_checkpoint"] is None
    assert not (tmp_path / "synthetic" / "hf").exists() and not (tmp_path / "synthetic" / "checkpoints").exists()


@pytest.mark.slow
def test_a_run_resumes_from_an_earlier_runs_checkpoint(tmp_path: Path) -> None:
    """`python train.py ckpt_path=<run>/checkpoints/last.ckpt`: Lightning restores weights, optimizer and step."""
    first = subprocess.run(train_cmd("trainer.max_steps=4", "hardware=cpu"), cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    (ckpt,) = tmp_path.glob("outputs/*/*/checkpoints/last.ckpt")
    again = subprocess.run(train_cmd(f"ckpt_path={ckpt}", "trainer.max_steps=6", "hardware=cpu"), cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Restored all states from the checkpoint at {ckpt}" in again.stdout + again.stderr
    run_dir = Path(re.findall(r"run directory: (\S+)", again.stdout + again.stderr)[-1])
    assert run_dir != ckpt.parent.parent
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6
    assert "`Trainer.fit` stopped: `max_steps=6` reached" in again.stdout + again.stderr
    other = subprocess.run(train_cmd(f"ckpt_path={ckpt}", "model.config.hidden_size=64", "hardware=cpu"), cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)  # another model's shape: one line, named
    errors = [line for line in other.stderr.splitlines() if line.startswith("error: ")]
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert len(errors) == 1 and f"ckpt_path={ckpt}: its weights do not fit this model (size mismatch" in errors[0]


def test_rows_longer_than_the_models_positions_are_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """data.seq_len (or a chat set's max_length) past the model's max_position_embeddings trains on
    extrapolated positions: one warning naming both keys (it was silent); within them, none."""
    from omegaconf import OmegaConf
    from transformers import LlamaConfig

    from megatrain_lightning.cli import warn_if_past_positions

    config = LlamaConfig(max_position_embeddings=64)
    with caplog.at_level("WARNING", logger="megatrain_lightning.cli"):
        warn_if_past_positions(OmegaConf.create({"seq_len": 64}), config)
        assert not caplog.records
        warn_if_past_positions(OmegaConf.create({"max_length": 128}), config)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "data.max_length=128 is longer than the model's max_position_embeddings=64"]
    assert "data.max_length=64, or model.config.max_position_embeddings=128" in caplog.records[0].getMessage()


def test_a_cuda_device_past_the_machines_is_refused_by_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with one GPU (stood in for here), strategy.device=cuda:5 and hardware.device=cuda:3 are refused
    naming the key and the devices there are (found 2026-12-07: Hydra's generic "Error in call to target")."""
    import dataclasses

    from omegaconf import OmegaConf

    from megatrain_lightning.cli import check_strategy_runs_here
    from megatrain_lightning.errors import ConfigError
    from megatrain_lightning.hardware import load_profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    h200 = load_profile("h200")
    node = OmegaConf.create({"_target_": "megatrain_lightning.MegaTrainStrategy", "device": "cuda:5"})
    with pytest.raises(ConfigError, match=r"^strategy.device=cuda:5: this machine has 1 CUDA device \(cuda:0\)$"):
        check_strategy_runs_here(node, "megatrain", h200)
    node.device = None
    with pytest.raises(ConfigError, match=r"^hardware.device=cuda:3: this machine has 1 CUDA device"):
        check_strategy_runs_here(node, "megatrain", dataclasses.replace(h200, device="cuda:3"))
    check_strategy_runs_here(node, "megatrain", h200)  # cuda:0 is there
