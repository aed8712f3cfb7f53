"""The training application behind `train.py`: one composed config in, one trained model out.

`train(cfg)` is a plain function (no Hydra inside, so tests and notebooks call it directly): it
checks the config's values against the constructors they go to (``schema.py``), resolves the hardware
profile, builds the model on the meta device to count its parameters, plans the run
(``megatrain_lightning.plan``: refusing a model whose training state cannot fit host memory), reads and
tokenises the data, and only then builds strategy and Trainer, validates (the starting exact match),
fits, and validates the final weights (unless the fit's last validation already did). Every run leaves
`run_info.json` (written before training: what was attempted), `metrics.json` (after: what it measured
and where its outputs are), `logs/metrics.csv`, `curves.png` (with matplotlib), `checkpoints/` and the
Hugging Face export `hf/` in its output directory, and prints where they are; the sweep table is built
from those.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from megatrain_lightning.errors import ConfigError
from megatrain_lightning.hardware import HardwareProfile, resolve_hardware
from megatrain_lightning.plan import GB, Plan, check_baseline_host, device_state_warning, plan_from_config, verdict
from megatrain_lightning.plan import from_config
from megatrain_lightning.plan.placement import placement_line

log = logging.getLogger(__name__)

# Strategies whose package is optional: `_target_` → (import name, install hint).
_OPTIONAL_PACKAGES = {
    "lightning.pytorch.strategies.DeepSpeedStrategy": ("deepspeed", "pip install deepspeed"),
}

# A planned device peak this many times the device's memory is refused before the build (an out-of-memory error
# for certain: the planner's peaks were within 10% of measured, docs/long_context.md); between 1x and this, a warning.
DEVICE_REFUSAL = 1.5
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
    if hw.accelerator != "cuda":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ConfigError(
            f"hardware={hw.name} is a CUDA GPU profile, but this machine has no CUDA GPU (torch {torch.__version__}"
            f"{'' if torch.version.cuda else ', a CPU-only build'}): use hardware=auto (or hardware=cpu) here; to "
            f"plan for that GPU without one, python -m megatrain_lightning.plan hardware={hw.name} ..."
        )
    device = strategy_node.get("device")
    for key, value in (("hardware.device", hw.device), ("strategy.device", device)):
        index = str(value).partition(":")[2] if value is not None and str(value).startswith("cuda:") else ""
        if index.isdigit() and int(index) >= count:
            raise ConfigError(f"{key}={value}: this machine has {count} CUDA device{'s' * (count > 1)} "
                              f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")


def resume_from(ckpt_path: Any) -> str | None:
    """``ckpt_path=...``: an existing checkpoint (a file, or a directory of shards), ``~`` expanded; refused by name
    before anything is built where there is none."""
    if ckpt_path is None:
        return None
    path = os.path.expanduser(str(ckpt_path))
    if not os.path.exists(path):
        raise ConfigError(
            f"ckpt_path={ckpt_path} does not exist: give the checkpoint of an earlier run, e.g. "
            "ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt (the run directory its log printed)"
        )
    from megatrain_lightning.checkpoint_io import checkpoint_keys

    keys = checkpoint_keys(path)  # without its tensors: a wrong file is refused before the model is built
    missing = [k for k in ("state_dict", "optimizer_states", "loops") if keys is not None and k not in keys]
    if missing:
        shown = ", ".join(keys[:6]) + (", ..." if len(keys) > 6 else "") if keys else "none"
        raise ConfigError(
            f"ckpt_path={ckpt_path} is not the checkpoint of a Lightning training run: it has no "
            f"{', '.join(missing)} (its top-level keys: {shown}). ckpt_path resumes a run train.py saved (its "
            "checkpoints/last.ckpt, with weights, optimizer state and loop progress); to start from other weights, "
            "set model.pretrained=<a Hugging Face checkpoint directory> instead")
    return path


def make_output_dir(out_dir: Path) -> None:
    """The run's output directory, created now: a path that cannot hold one is refused by name before the build."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"paths.output_dir={out_dir} cannot be created ({err.strerror or err}): set paths.output_dir "
                          "to a writable directory") from None


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
        plan = from_config.planned_run(cfg, _overrides(), refuse_device=False)  # may pick an MoE's micro-batch
        if plan.picked:
            log.info("%s", plan.picked)
        if plan.chosen:
            # The strategy chooses the open fields itself, from its measured first step; only saved inputs
            # the streaming placement needs offloaded (it would not fit the device otherwise) are set here.
            offload = plan.run.engine.offload_inputs
            if "offload_inputs" in plan.chosen and offload:
                cfg.strategy.engine.offload_inputs = offload
            log.info("%s", placement_line(plan.run.engine, plan.chosen))
        log.info("%s", verdict(plan))
        if plan.moe_warning:
            log.warning("%s", plan.moe_warning)
        if plan.gpu_total > DEVICE_REFUSAL * plan.gpu_available:  # far over: refused with what to change
            from_config.planned_run(cfg, _overrides())  # the same plan, its device checked: raises ConfigError
        if plan.gpu_total > plan.gpu_available:
            log.warning("the planner puts the device peak at %.1f GB, over the %.1f GB available: expect an "
                        "out-of-memory error (python -m megatrain_lightning.plan ... says what to change)",
                        plan.gpu_total / GB, plan.gpu_available / GB)
        return plan, plan.host_total
    target = str(cfg.strategy.get("_target_"))
    if target.endswith(_DEVICE_RESIDENT):
        if hw.accelerator != "cuda":  # the device is the host: the whole training state lives in host memory
            return None, check_baseline_host(model_name, num_params, hw)
        warning = device_state_warning(num_params, hw.device_memory_gb, strategy_name)
        if warning:
            log.warning(warning)
        return None, 0.0
    return None, check_baseline_host(model_name, num_params, hw)


def _overrides() -> list[str]:
    """The command line's overrides of this run (a multirun job's: its own), [] outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


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


def has_validation(trainer_node: DictConfig, data: Any) -> bool:
    """Whether the run validates: the data module has held-out samples and the Trainer does not turn it off."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not trainer_node.get("limit_val_batches", 1.0) or not is_overridden("val_dataloader", data):
        return False
    loader = data.val_dataloader()
    return bool(len(loader)) if hasattr(loader, "__len__") else True


def build_callbacks(trainer_node: DictConfig, validates: bool, saves_model: bool = True,
                    logged: tuple[str, ...] = ()) -> list[Any]:
    """The Trainer's callbacks from ``trainer.callbacks`` (by name; null entries skipped): the checkpoint
    callback only with ``enable_checkpointing``, and monitoring nothing (``last.ckpt`` only) without validation;
    neither checkpoints nor the export when the data teaches nothing (``saves_model`` false: random tokens).
    ``logged``: the metrics the model logs; a checkpoint monitor that is none of them but close to one is taken for
    a misspelling and refused now (Lightning would fail at the first validation, after hours perhaps)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from megatrain_lightning.callbacks import HFExport

    nodes = trainer_node.get("callbacks") or {}
    if isinstance(nodes, ListConfig):  # a plain list (older configs): every entry
        nodes = {str(i): n for i, n in enumerate(nodes)}
    callbacks = []
    for name, node in nodes.items():
        if node is None:
            continue
        try:
            cls = hydra.utils.get_class(str(node.get("_target_", "")))
        except Exception:  # not a class we can import: instantiate below says why, in its own words
            cls = None
        is_checkpoint = isinstance(cls, type) and issubclass(cls, ModelCheckpoint)
        if is_checkpoint and trainer_node.get("enable_checkpointing") is False:
            continue
        if not saves_model and isinstance(cls, type) and (is_checkpoint or issubclass(cls, HFExport)):
            log.info("trainer.callbacks.%s: not used, the data (random tokens) teaches nothing worth saving", name)
            continue
        if is_checkpoint and not validates and node.get("monitor") is not None:
            node = OmegaConf.merge(node, {"monitor": None})
        monitor = node.get("monitor") if is_checkpoint else None
        close = [] if monitor is None or monitor in logged else difflib.get_close_matches(str(monitor), logged, 1, 0.75)
        if close:
            raise ConfigError(f"trainer.callbacks.{name}.monitor={monitor}: the model logs no such metric (did you "
                              f"mean {close[0]}? it logs {', '.join(logged)})")
        callbacks.append(instantiate(node))
    return callbacks


def check_data_vocabulary(data_node: DictConfig, text_config: Any) -> None:
    """``data.vocab_size`` (synthetic tokens' range) within the model's embedding: an id past it fails on the device
    as an index error (a CUDA assert), or trains rows the embedding does not have."""
    size, vocab = data_node.get("vocab_size"), getattr(text_config, "vocab_size", None)
    if isinstance(size, int) and isinstance(vocab, int) and not 1 <= size <= vocab:
        raise ConfigError(f"data.vocab_size={size}: token ids are drawn below it, so it must be between 1 and the "
                          f"model's vocabulary ({vocab}): set data.vocab_size={vocab} (or null: the tokenizer's size)")


def check_gives_batches(data_node: DictConfig, data: Any) -> None:
    """Refuse data that gives no training batch (fewer samples than one batch, whose last partial batch is
    dropped): Lightning would end the fit at once, with nothing trained and exit 0."""
    loader = data.train_dataloader()
    if not hasattr(loader, "__len__") or len(loader):
        return
    dataset = getattr(loader, "dataset", None)
    rows = len(dataset) if hasattr(dataset, "__len__") else "too few"
    raise ConfigError(
        f"the training data gives no batch: {rows} training samples, fewer than one batch of data.batch_size="
        f"{data_node.get('batch_size')}. Lower data.batch_size, or give more data"
        + (" (data.num_samples)" if "num_samples" in data_node else ""))


def warn_if_past_positions(data_node: DictConfig, text_config: Any) -> None:
    """One warning when the data's rows (``data.seq_len``, or ``data.max_length`` for chat data) are longer
    than the positions the model was configured for: its rotary embedding extrapolates past them."""
    key = "seq_len" if "seq_len" in data_node else "max_length"
    length, positions = data_node.get(key), getattr(text_config, "max_position_embeddings", None)
    if isinstance(length, int) and isinstance(positions, int) and length > positions:
        log.warning("data.%s=%d is longer than the model's max_position_embeddings=%d: positions past %d are "
                    "extrapolated. Set data.%s=%d, or model.config.max_position_embeddings=%d for a model built from "
                    "model.config (a pretrained one needs rope_scaling)", key, length, positions, positions, key,
                    positions, length)


def warn_if_disk_is_short(out_dir: Path, num_params: int, callbacks: list[Any], host_state: str | None) -> None:
    """A warning (not a refusal: these are estimates) when the run's checkpoints and export may not fit the disk."""
    import shutil

    from lightning.pytorch.callbacks import ModelCheckpoint

    from megatrain_lightning.callbacks import HFExport

    per_ckpt = num_params * (8 if host_state == "compact" else 12)  # weights + AdamW moments
    files = sum(1 + bool(c.monitor) for c in callbacks if isinstance(c, ModelCheckpoint))
    export = sum(num_params * (c.dtype.itemsize if c.dtype is not None else 4) for c in callbacks if isinstance(c, HFExport))
    need = files * per_ckpt + export
    where = next((p for p in (out_dir, *out_dir.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(where).free
    if need > free:
        log.warning("checkpoints and export may need %.1f GB but %s has %.1f GB free: set trainer.callbacks.checkpoint="
                    "null and/or trainer.callbacks.hf_export=null (or +trainer.callbacks.hf_export.dtype=bfloat16), or "
                    "paths.output_dir=<a larger disk>", need / GB, where, free / GB)


def _find(callbacks: list[Any], cls: type) -> Any:
    return next((c for c in callbacks if isinstance(c, cls)), None)


def report_outputs(out_dir: Path, callbacks: list[Any]) -> dict[str, str | None]:
    """What the run left and where (for metrics.json and the closing lines), the curves drawn first."""
    from megatrain_lightning.callbacks import HFExport, RunCheckpoint
    from megatrain_lightning.plot import plot_run

    export = _find(callbacks, HFExport)
    ckpt = _find(callbacks, RunCheckpoint)
    png = plot_run(out_dir)
    outputs = {
        "run_dir": str(out_dir.resolve()),
        "hf_dir": str(export.dirpath.resolve()) if export is not None and export.last_exported_step is not None else None,
        "last_checkpoint": ckpt.last_model_path or None if ckpt is not None else None,
        "best_checkpoint": ckpt.best_model_path or None if ckpt is not None else None,
        "metrics_csv": str((out_dir / "logs" / "metrics.csv").resolve()) if (out_dir / "logs" / "metrics.csv").is_file() else None,
        "curves_png": str(png.resolve()) if png is not None else None,
    }
    return outputs


def _print_outputs(outputs: dict[str, str | None]) -> None:
    lines = [f"run directory: {outputs['run_dir']}"]
    if outputs["hf_dir"]:
        lines.append(f"  Hugging Face model: {outputs['hf_dir']}  (AutoModelForCausalLM.from_pretrained(path))")
    for key, what in (("last_checkpoint", "last checkpoint"), ("best_checkpoint", "best checkpoint"),
                      ("metrics_csv", "per-step metrics"), ("curves_png", "curves")):
        if outputs[key]:
            lines.append(f"  {what}: {outputs[key]}")
    lines.append(f"  summary: {Path(outputs['run_dir']) / 'metrics.json'}")
    print("\n".join(lines), flush=True)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one training job from a composed config; returns (and writes) its metrics.

    Raises ConfigError for input a user can fix, before anything large is allocated: the config's values
    are checked against the constructors they go to, and the data is read and tokenised before the
    model is materialised.
    """
    import lightning.pytorch as pl

    from megatrain_lightning.callbacks import RunSummary
    from megatrain_lightning.callbacks.memory import peak_gpu_reserved_bytes, peak_host_rss_bytes
    from megatrain_lightning.callbacks.throughput import ThroughputMonitor
    from megatrain_lightning.schema import check_config, check_root, check_set, check_trainer_values

    started = time.perf_counter()
    out_dir = Path(cfg.paths.output_dir)
    try:
        check_root(cfg)
        make_output_dir(out_dir)
        ckpt_path = resume_from(cfg.get("ckpt_path"))
        check_config(cfg, groups=("hardware",))
        hw = resolve_hardware(cfg)
        check_config(cfg, groups=("trainer", "data", "model", "strategy"))  # after: they read ${hardware.*}
        check_set(cfg, ("trainer", "data", "model", "strategy"), "python train.py")
        check_trainer_values(cfg.trainer)
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
                    predicted_step_s=round(plan.step_s, 4) if plan is not None else None,
                    micro_batch_picked=int(cfg.data.batch_size) if plan is not None and plan.picked else None)
        _write_json(out_dir / "run_info.json", info)
        check_data_vocabulary(cfg.data, model.hf_config.get_text_config())
        data = instantiate(cfg.data, tokenizer=model.tokenizer)
        data.setup("fit")  # read and tokenise now: bad data fails here, not after the model is built
        check_gives_batches(cfg.data, data)
        warn_if_past_positions(cfg.data, model.hf_config.get_text_config())
        validates = has_validation(cfg.trainer, data)
        callbacks = build_callbacks(cfg.trainer, validates, saves_model=getattr(data, "saves_model", True),
                                    logged=tuple(getattr(model, "logged_metrics", ())))
        engine = cfg.strategy.get("engine") if _is_megatrain(cfg.strategy) else None
        warn_if_disk_is_short(out_dir, shape.total_params, callbacks, engine.get("host_state") if engine else None)
        strategy = build_strategy(cfg.strategy, hw, plan)
        trainer_node = OmegaConf.create(OmegaConf.to_container(cfg.trainer, resolve=True))
        trainer_node.pop("callbacks", None)  # built above, by name
        trainer: pl.Trainer = instantiate(trainer_node, strategy=strategy, callbacks=callbacks)
    except MissingMandatoryValue as err:
        raise ConfigError(f"{err.full_key} must be set, e.g. python train.py {err.full_key}=...") from None
    except OmegaConfBaseException as err:  # e.g. an interpolation that does not resolve
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key + ': ' if key else ''}{str(err).splitlines()[0]}") from None

    start_em = None
    if validates:
        start_em = _metric(trainer.validate(model, datamodule=data, verbose=False)[0], "val/exact_match")
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except RuntimeError as err:
        if ckpt_path is None or not str(err).startswith("Error(s) in loading state_dict"):
            raise
        first = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), "")
        raise ConfigError(f"ckpt_path={ckpt_path}: its weights do not fit this model ({first}): resume with the model "
                          "settings that run was trained with (its .hydra/config.yaml), or start a new run without "
                          "ckpt_path") from None
    run = _find(trainer.callbacks, RunSummary)
    final: dict[str, Any] = {}
    if validates:  # the fit's own last validation, when it ran on the final weights; else one more
        if run is not None and run.last_val_step == trainer.global_step and run.last_val_metrics:
            final = run.last_val_metrics
        else:
            final = trainer.validate(model, datamodule=data, verbose=False)[0]
    if trainer.logger is not None:
        trainer.logger.save()  # metrics.csv complete before it is plotted

    throughput = _find(trainer.callbacks, ThroughputMonitor)
    batch_shape = throughput.last_batch_shape if throughput is not None else None
    summary = throughput.summary if throughput is not None else {}  # whole-run averages
    metrics = {
        **info,
        "micro_batch": batch_shape[0] if batch_shape else None,
        "seq_len": batch_shape[1] if batch_shape else None,
        "steps": trainer.global_step,
        **(run.summary if run is not None else {}),
        "tokens_per_s": summary.get("tokens/s"),
        "step_s": summary["s/batch"] * int(cfg.trainer.get("accumulate_grad_batches") or 1) if summary else None,
        "tflops": summary.get("TFLOPS"),
        "mfu": summary.get("MFU"),
        "peak_gpu_mem_gib": peak_gpu_reserved_bytes() / 1024**3,
        "peak_host_rss_gib": peak_host_rss_bytes() / 1024**3,
        "exact_match_start": start_em,
        "exact_match": _metric(final, "val/exact_match"),
        "val_loss": _metric(final, "val/loss"),
    }
    chosen = getattr(trainer.strategy, "placement_summary", None)
    if chosen is not None:  # the strategy chose the placement from its measured first step
        metrics["placement"] = chosen
        if chosen.get("predicted_step_s") is not None:
            metrics["predicted_step_s"] = chosen["predicted_step_s"]
    outputs = report_outputs(out_dir, trainer.callbacks)
    metrics.update(duration_s=round(time.perf_counter() - started, 1), **outputs)
    _write_json(out_dir / "metrics.json", metrics)
    log.info("metrics: %s", json.dumps(metrics, default=str))
    _print_outputs(outputs)
    return metrics
