# python recipes/planner_vs_measured.py
"""Planner predictions against the measured H200 runs (recipes/results/2026-11-30-h200-throughput.md).

Prints a markdown table: predicted vs measured step time, peak GPU memory (the planner sums tensor bytes:
compared with torch's max_memory_allocated; reserved shown beside it) and peak host RSS, with the % error.
Measured numbers are copied from the results file; nothing here is fitted to them. All runs: random init,
bf16-mixed, sequence 2048, slots=3, on the device machine (nvidia-h200: 135 GB host memory; the 14B run
on nvidia-h200-x2: 256 GiB host memory, one of its GPUs).
"""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from megatrain_lightning.conf_dir import config_dir
from megatrain_lightning.plan import GIB, plan_from_config

COMMON = ["data=synthetic", "hardware=h200", "hardware.host_memory_gb=135", "hardware.slots=3", "data.seq_len=2048"]


def _run(model: str, mb: int, acc: int = 1, keep: int = 0, cache: int = 0, chunk: int | None = 4096,
         offload: bool = False, layers: int | None = None, host_gb: int | None = None, grad_buffers: int = 0,
         run_on: bool = False, kept_saves: str = "all", host_state: str = "fp32", bf16_grads: bool = False) -> list[str]:
    """Defaults: what the first runs had (every block its own fp32 accumulator, the host step finished
    before the next forward); the later runs name their pool, run-on and kept_saves."""
    over = [f"model={model}", f"data.batch_size={mb}", f"trainer.accumulate_grad_batches={acc}",
            f"strategy.engine.keep_activations={keep}", f"strategy.engine.cache_weights={cache}",
            f"strategy.engine.offload_inputs={offload}", f"model.loss_chunk_tokens={chunk if chunk else 'null'}",
            f"strategy.engine.grad_buffers={grad_buffers}", f"strategy.engine.overlap_next_forward={run_on}",
            f"strategy.engine.kept_saves={kept_saves}", f"strategy.engine.host_state={host_state}",
            f"strategy.engine.bf16_grads={bf16_grads}"]
    if layers:
        over.append(f"model.config.num_hidden_layers={layers}")
    if host_gb:
        over.append(f"hardware.host_memory_gb={host_gb}")
    return over


RUNS = {  # name: (overrides, measured step s, peak GPU allocated GiB, peak GPU reserved GiB, peak host RSS GiB)
    # session 10, last call (commit 12283d1, the final defaults: bf16 gradients into the one-pass AdamW)
    "7B, 16 x 2048, run-on, pool of 4, keep 24 saving matmuls, cache 28, loss chunk 4096, head in backward, bf16 gradients": (
        _run("qwen2_5_7b", 16, keep=24, cache=28, run_on=True, grad_buffers=4, kept_saves="matmuls", bf16_grads=True),
        3.5018, 123.56, 127.22, 94.34),
    "14B shape (48 blocks), compact state, one-pass compact kernel, bf16 gradients, 8 x 2048, run-on, pool of 4, keep 4, cache 48, loss chunk 4096, head in backward (10 steps)": (
        _run("qwen2_5_14b", 8, keep=4, cache=48, run_on=True, grad_buffers=4, host_state="compact", bf16_grads=True),
        4.1558, 79.07, 88.05, 121.61),
    # session 10 (commit aabbdfd): bf16 gradients through the one-pass kernel, the default since (mean of two runs)
    "3B, run-on, own accumulators, keep 32, cache 36, loss chunk 4096, bf16 gradients (one-pass kernel)": (
        _run("qwen2_5_3b", 8, keep=32, cache=36, run_on=True, bf16_grads=True), 1.005, 92.11, 95.11, 42.56),
    # the last runs (commit 2ad7437, --fp32-grads: the default since)
    "7B, 16 x 2048, run-on, pool of 4, keep 24 saving matmuls, cache 28, loss chunk 4096, head in backward": (
        _run("qwen2_5_7b", 16, keep=24, cache=28, run_on=True, grad_buffers=4, kept_saves="matmuls"), 3.5465, 123.56, 127.22, 94.27),
    # commit d6b251a: untied head updated in the backward
    "7B, 16 x 2048, run-on, pool of 4, keep 20 saving matmuls, cache 28, loss chunk 4096, head in backward": (
        _run("qwen2_5_7b", 16, keep=20, cache=28, run_on=True, grad_buffers=4, kept_saves="matmuls"), 3.698, 110.55, 114.5, 94.27),
    # commit 675f94b: all 48 blocks of the 14B shape in compact state, the largest model on nvidia-h200
    "14B shape (48 blocks), compact state, 8 x 2048, run-on, pool of 4, keep 4, cache 48, loss chunk 4096, head in backward": (
        _run("qwen2_5_14b", 8, keep=4, cache=48, run_on=True, grad_buffers=4, host_state="compact"),
        15.4409, 79.07, 88.05, 121.71),
    "14B shape with 46 blocks, compact state, 8 x 2048, run-on, pool of 4, keep 4, cache 46, loss chunk 4096, head in backward": (
        _run("qwen2_5_14b", 8, keep=4, cache=46, layers=46, run_on=True, grad_buffers=4, host_state="compact"),
        14.1975, 77.42, 86.29, 117.61),
    # later the same day: updates run on into the next forward, kept blocks saving matmul outputs
    "3B, run-on, own accumulators (grad_buffers 0), keep 32, cache 36, loss chunk 4096": (
        _run("qwen2_5_3b", 8, keep=32, cache=36, run_on=True), 1.049, 92.11, 95.11, 47.68),
    "7B, 16 x 2048, run-on, pool of 4, keep 20 saving matmuls, cache 28, loss chunk 4096": (
        _run("qwen2_5_7b", 16, keep=20, cache=28, run_on=True, grad_buffers=4, kept_saves="matmuls"), 3.8071, 114.61, 118.56, 94.27),
    # the first runs
    "3B, 8 x 2048, keep 32, cache 36, loss chunk 4096": (_run("qwen2_5_3b", 8, keep=32, cache=36), 1.3036, 95.58, 98.59, 52.36),
    "7B, 16 x 2048, keep 6, cache 28, loss chunk 4096": (_run("qwen2_5_7b", 16, keep=6, cache=28), 4.0492, 94.75, 97.94, 115.16),
    "7B, 8 x 2048, accumulate 4, keep 10, cache 28": (_run("qwen2_5_7b", 8, acc=4, keep=10, cache=28, chunk=None), 9.2162, 99.78, 104.75, 123.24),
    "7B, 4 x 2048, accumulate 8, keep 28, cache 28": (_run("qwen2_5_7b", 4, acc=8, keep=28, cache=28, chunk=None), 11.5102, 97.59, 100.14, 123.24),
    "14B (h200-x2 host), 8 x 2048, keep 4, cache 48, loss chunk 4096": (
        _run("qwen2_5_14b", 8, keep=4, cache=48, host_gb=275), 4.4591, 85.9, 96.33, 221.77),
    "1.5B width, 28 blocks, 4 x 2048, accumulate 4, offloaded inputs": (
        _run("qwen2_5_1_5b", 4, acc=4, chunk=None, offload=True, layers=28), 2.1104, 20.18, 23.5, 33.39),
    "1.5B width, 112 blocks, 4 x 2048, accumulate 4, offloaded inputs": (
        _run("qwen2_5_1_5b", 4, acc=4, chunk=None, offload=True, layers=112), 6.5426, 20.18, 23.5, 97.36),
}


def main() -> None:
    print("| run | quantity | predicted | measured | error |")
    print("| --- | --- | --- | --- | --- |")
    for name, (over, step, alloc, reserved, rss) in RUNS.items():
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose(config_name="train", overrides=COMMON + over)
        # the code each run measured: the untied head's update in the backward only in those named so, the
        # one-pass compact kernel likewise
        plan = plan_from_config(cfg, refuse_device=False, head_in_backward="head in backward" in name,
                                compact_native="one-pass compact kernel" in name)
        for q, pred, meas, unit in (
            ("step time", plan.step_s, step, "s"),
            (f"peak GPU (allocated; reserved {reserved:.2f} GiB)", plan.gpu_total / GIB, alloc, "GiB"),
            ("peak host RSS", plan.host_total / GIB, rss, "GiB"),
        ):
            print(f"| {name} | {q} | {pred:.2f} {unit} | {meas:.2f} {unit} | {100 * (pred - meas) / meas:+.1f}% |")
        print(f"| {name} | bottleneck named | {plan.bottleneck} | | |")
        detail = ", ".join(f"{k} {v:.3f}" for k, v in plan.times.items())
        print(f"<!-- {name}: {detail}; GPU items GB: "
              + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in plan.gpu.items()) + " -->")


if __name__ == "__main__":
    main()
