# python recipes/planner_vs_measured.py
"""Planner predictions against the measured H200 runs (recipes/results/2026-11-30-h200-throughput.md).

Prints a markdown table: predicted vs measured step time, peak GPU memory (reserved) and peak host RSS,
with the % error. Measured numbers are copied from the results file; nothing here is fitted to them.
The runs used Hugging Face's loss (no chunking), slots=3, on the device machine (135 GB host memory).
"""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from megatrain_lightning.plan import plan_from_config
from megatrain_lightning.planner import GIB

CONF = __import__("pathlib").Path(__file__).resolve().parent.parent / "conf"
COMMON = ["data=synthetic", "hardware=h200", "hardware.host_memory_gb=135", "hardware.slots=3",
          "model.loss_chunk_tokens=null", "data.batch_size=8", "data.seq_len=2048"]
RUNS = {  # name: (overrides, measured step s, peak GPU reserved GiB, peak host RSS GiB)
    "Qwen2.5-3B shape, 8 x 2048, accumulate 1": (["model=qwen2_5_3b"], 1.639, 48.89, 52.37),
    "Qwen2.5-7B shape, 8 x 2048, accumulate 4": (["model=qwen2_5_7b", "trainer.accumulate_grad_batches=4"], 9.655, 60.34, 123.2),
}


def main() -> None:
    print("| run | quantity | predicted | measured | error |")
    print("| --- | --- | --- | --- | --- |")
    for name, (over, step, gpu, rss) in RUNS.items():
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="train", overrides=COMMON + over)
        plan = plan_from_config(cfg)
        for q, pred, meas, unit in (
            ("step time", plan.step_s, step, "s"),
            ("peak GPU (reserved)", plan.gpu_total / GIB, gpu, "GiB"),
            ("peak host RSS", plan.host_total / GIB, rss, "GiB"),
        ):
            print(f"| {name} | {q} | {pred:.2f} {unit} | {meas:.2f} {unit} | {100 * (pred - meas) / meas:+.1f}% |")
        print(f"| {name} | bottleneck named | {plan.bottleneck} | | |")
        detail = ", ".join(f"{k} {v:.3f}" for k, v in plan.times.items())
        print(f"<!-- {name}: {detail}; GPU items GB: "
              + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in plan.gpu.items()) + " -->")


if __name__ == "__main__":
    main()
