"""The training application behind `train.py`: one composed config in, one trained model out.

`train(cfg)` is a plain function (no Hydra inside, so tests and notebooks call it directly): it
resolves the hardware profile, builds the model on the meta device to count its parameters, refuses
a model whose training state cannot fit host memory, and only then instantiates data, strategy and
Trainer, validates (the starting exact match), fits, and validates again. Every run leaves
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
from megatrain_lightning.hardware import HardwareProfile
from megatrain_lightning.plan import (
    GB,
    check_fits,
    device_state_warning,
    estimate_host_bytes,
    pin_memory_fits,
    state_bytes_per_param,
    state_description,
)

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


def resolve_hardware(cfg: DictConfig) -> HardwareProfile:
    """Instantiate the hardware profile (running detection for `auto`) and write it back into `cfg`.

    Other groups interpolate `${hardware.slots}` and the like; after this they read the detected
    numbers, which `auto.yaml` cannot know when it is composed.
    """
    profile = instantiate(cfg.hardware)
    if not isinstance(profile, HardwareProfile):
        raise ConfigError(f"hardware config gave a {type(profile).__name__}, not a HardwareProfile")
    with open_dict(cfg):
        cfg.hardware = OmegaConf.create(dataclasses.asdict(profile))
    return profile


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


def build_strategy(node: DictConfig, hw: HardwareProfile, num_params: int) -> Any:
    """The strategy, with `pin_memory: null` decided by the profile's pinned-memory budget."""
    kwargs: dict[str, Any] = {}
    if "pin_memory" in node and node.pin_memory is None and hw.accelerator == "cuda":
        kwargs["pin_memory"] = pin_memory_fits(num_params, hw.pinned_budget_gb)
    return instantiate(node, **kwargs)


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
        pooled = (
            str(cfg.strategy.get("_target_", "")).endswith("MegaTrainStrategy")
            and (cfg.strategy.get("grad_buffers") is None or int(cfg.strategy.get("grad_buffers")) > 0)
            and int(cfg.trainer.get("accumulate_grad_batches") or 1) == 1
            and not cfg.trainer.get("gradient_clip_val")
        )
        # 16 B/param, 12 with host_state=compact; 4 less when the gradients live in the pooled buffers
        state_bytes = state_bytes_per_param(cfg.strategy.get("host_state"), pooled)
        info = {
            "model": model_name,
            "params": shape.total_params,
            "active_params": shape.active_params,
            "strategy": strategy_name,
            "hardware": hw.name,
            "host_state_gb": round(estimate_host_bytes(shape.total_params, state_bytes) / GB, 3),
        }
        _write_json(out_dir / "run_info.json", info)
        check_fits(shape.total_params, hw.host_memory_gb, model=model_name, hardware=hw.name, state_bytes=state_bytes,
                   what=state_description(cfg.strategy.get("host_state"), pooled))
        if hw.accelerator == "cuda" and str(cfg.strategy.get("_target_")).endswith(_DEVICE_RESIDENT):
            warning = device_state_warning(shape.total_params, hw.device_memory_gb, strategy_name)
            if warning:
                log.warning(warning)
        log.info(
            "plan: %s, %.3f B parameters (%.3f B active per token); host state %.1f GB of %.0f GB; "
            "weights stream in %.2f s per pass (fp32 masters, cast on the device) at %.0f GB/s",
            model_name, shape.total_params / 1e9, shape.active_params / 1e9,
            info["host_state_gb"], hw.host_memory_gb, 4 * shape.total_params / GB / hw.link_gb_per_s,
            hw.link_gb_per_s,
        )
        data = instantiate(cfg.data, tokenizer=model.tokenizer)
        strategy = build_strategy(cfg.strategy, hw, shape.total_params)
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
