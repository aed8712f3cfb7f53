"""The training application behind `train.py`: one composed config in, one trained model out.

`train(cfg)` is a plain function (no Hydra inside, so tests and notebooks call it directly): it
resolves the hardware profile, builds the model on the meta device to count its parameters, plans the
run (``megatrain_lightning.plan``: refusing a model whose training state cannot fit host memory), and
only then instantiates data, strategy and Trainer, validates (the starting exact match), fits, and
validates again. Every run leaves
`run_info.json` (written before training: what was attempted) and `metrics.json` (after: what it
measured) in its output directory; the sweep table is built from those.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from megatrain_lightning.errors import ConfigError
from megatrain_lightning.hardware import HardwareProfile, resolve_hardware
from megatrain_lightning.plan import GB, Plan, check_baseline_host, device_state_warning, plan_from_config, verdict

log = logging.getLogger(__name__)

# Strategies whose package is optional: `_target_` → (import name, install hint).
_OPTIONAL_PACKAGES = {
    "lightning.pytorch.strategies.DeepSpeedStrategy": ("deepspeed", "pip install deepspeed"),
}

# Strategies that keep every byte of training state on the device.
_DEVICE_RESIDENT = ("SingleDeviceStrategy",)
# Lightning refuses these without a GPU accelerator.
_CUDA_ONLY = ("FSDPStrategy", "DeepSpeedStrategy")


def instantiate(node: DictConfig, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate` that lets a ConfigError from a constructor surface as itself.

    Hydra wraps constructor exceptions in InstantiationException (a traceback-shaped message);
    bad input deserves its own one-line message. Nested configs also come out as plain containers.
    """
    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while isinstance(cause, InstantiationException):
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise


def choice(cfg: DictConfig, group: str) -> str:
    """The option chosen for a config group (`model=qwen2_5_7b` → `qwen2_5_7b`), outside Hydra too."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        choices = HydraConfig.get().runtime.choices
    else:  # no Hydra app running: a test or notebook composed the config (return_hydra_config=True)
        choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {}
    if choices.get(group):
        return str(choices[group])
    node = cfg.get(group)
    if node is not None and node.get("name"):
        return str(node.name)
    return str(node.get("_target_", "?")).rsplit(".", 1)[-1] if node is not None else "?"


def check_strategy_runs_here(strategy_node: DictConfig, name: str, hw: HardwareProfile) -> None:
    """A clear error, before anything is built, for a strategy whose package or GPU is missing."""
    target = str(strategy_node.get("_target_"))
    need = _OPTIONAL_PACKAGES.get(target)
    if need and importlib.util.find_spec(need[0]) is None:
        raise ConfigError(
            f"strategy={name} needs the {need[0]} package, which is not installed: {need[1]} "
            f"(on a CUDA machine), or choose strategy=megatrain or strategy=fsdp_cpu_offload"
        )
    if target.endswith(_CUDA_ONLY) and hw.accelerator != "cuda":
        raise ConfigError(
            f"strategy={name} runs only on CUDA GPUs, but hardware={hw.name} has accelerator={hw.accelerator}: "
            f"choose a GPU hardware profile, or strategy=megatrain or strategy=single_device"
        )


def build_strategy(node: DictConfig, hw: HardwareProfile, plan: Plan | None) -> Any:
    """The strategy, with MegaTrain's ``engine.pin_memory: null`` decided by the plan's pinned-memory budget."""
    engine = node.get("engine")
    if plan is not None and engine is not None and engine.get("pin_memory") is None and hw.accelerator == "cuda":
        with open_dict(node):
            node.engine.pin_memory = plan.pinned_ok
    return instantiate(node)


def _is_megatrain(node: DictConfig) -> bool:
    return str(node.get("_target_", "")).endswith("MegaTrainStrategy")


def check_fits(cfg: DictConfig, hw: HardwareProfile, model_name: str, strategy_name: str, num_params: int) -> tuple[Plan | None, float]:
    """The fit check of the chosen strategy, before anything large is allocated: MegaTrain's plan (host
    refusal, device warning), or the 16 B/param of a baseline. Returns the plan (MegaTrain) and the host
    bytes of training state it counts."""
    if _is_megatrain(cfg.strategy):
        plan = plan_from_config(cfg, refuse_device=False)
        log.info("%s", verdict(plan))
        if plan.moe_warning:
            log.warning("%s", plan.moe_warning)
        if plan.gpu_total > plan.gpu_available:
            log.warning("the planner puts the device peak at %.1f GB, over the %.1f GB available: expect an "
                        "out-of-memory error (python -m megatrain_lightning.plan ... says what to change)",
                        plan.gpu_total / GB, plan.gpu_available / GB)
        return plan, plan.host_total
    target = str(cfg.strategy.get("_target_"))
    if target.endswith(_DEVICE_RESIDENT):
        if hw.accelerator == "cuda":
            warning = device_state_warning(num_params, hw.device_memory_gb, strategy_name)
            if warning:
                log.warning(warning)
        return None, 0.0
    return None, check_baseline_host(model_name, num_params, hw)


def machine() -> str:
    """What ran this: $MACHINE if set (e.g. nvidia-h200), the GPU, the host cores, torch and transformers."""
    import os

    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    label = os.environ.get("MACHINE")
    return (f"{label + ': ' if label else ''}{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def _metric(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else float(value)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one training job from a composed config; returns (and writes) its metrics.

    Raises ConfigError for input a user can fix, before anything large is allocated.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from megatrain_lightning.callbacks.memory import peak_gpu_reserved_bytes, peak_host_rss_bytes
    from megatrain_lightning.callbacks.throughput import ThroughputMonitor

    started = time.perf_counter()
    out_dir = Path(cfg.paths.output_dir)
    try:
        hw = resolve_hardware(cfg)
        strategy_name, model_name = choice(cfg, "strategy"), choice(cfg, "model")
        check_strategy_runs_here(cfg.strategy, strategy_name, hw)
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        model = instantiate(cfg.model)  # meta device only: parameters counted, nothing allocated
        shape = model.model_shape
        info: dict[str, Any] = {
            "machine": machine(),
            "model": model_name,
            "params": shape.total_params,
            "active_params": shape.active_params,
            "strategy": strategy_name,
            "hardware": hw.name,
        }
        _write_json(out_dir / "run_info.json", info)  # what was attempted, even if refused next
        plan, host_state_bytes = check_fits(cfg, hw, model_name, strategy_name, shape.total_params)
        info.update(host_state_gb=round(host_state_bytes / GB, 3),
                    predicted_step_s=round(plan.step_s, 4) if plan is not None else None)
        _write_json(out_dir / "run_info.json", info)
        data = instantiate(cfg.data, tokenizer=model.tokenizer)
        strategy = build_strategy(cfg.strategy, hw, plan)
        trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy)
    except MissingMandatoryValue as err:
        raise ConfigError(f"{err.full_key} must be set, e.g. python train.py {err.full_key}=...") from None

    validates = bool(trainer.limit_val_batches) and is_overridden("val_dataloader", data)
    start_em = None
    if validates:
        start_em = _metric(trainer.validate(model, datamodule=data, verbose=False)[0], "val/exact_match")
    trainer.fit(model, datamodule=data)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    final_em = None
    if validates:
        final_em = _metric(trainer.validate(model, datamodule=data, verbose=False)[0], "val/exact_match")

    throughput = next((c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)), None)
    batch_shape = throughput.last_batch_shape if throughput is not None else None
    summary = throughput.summary if throughput is not None else {}  # whole-run averages
    metrics = {
        **info,
        "micro_batch": batch_shape[0] if batch_shape else None,
        "seq_len": batch_shape[1] if batch_shape else None,
        "steps": trainer.global_step,
        "loss": fit_metrics.get("loss"),
        "tokens_per_s": summary.get("tokens/s"),
        "step_s": summary["s/batch"] * int(cfg.trainer.get("accumulate_grad_batches") or 1) if summary else None,
        "tflops": summary.get("TFLOPS"),
        "mfu": summary.get("MFU"),
        "peak_gpu_mem_gib": peak_gpu_reserved_bytes() / 1024**3,
        "peak_host_rss_gib": peak_host_rss_bytes() / 1024**3,
        "exact_match_start": start_em,
        "exact_match": final_em,
        "duration_s": round(time.perf_counter() - started, 1),
    }
    _write_json(out_dir / "metrics.json", metrics)
    log.info("metrics: %s", json.dumps(metrics, default=str))
    return metrics
