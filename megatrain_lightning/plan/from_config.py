"""The plan of a composed training config (``conf/``), as ``train.py`` would run it: the model on the meta
device only, the hardware profile resolved, the strategy's EngineConfig instantiated and its open placement
fields chosen (``placement.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import EngineConfig
from ..errors import ConfigError
from ..hardware import resolve_hardware
from .fit import Plan, make_plan, resolve
from .placement import choose_placement
from .run import Workload
from .shape import PlanShape


def engine_config(cfg: Any) -> EngineConfig:
    """The ``strategy.engine`` node of a composed config as an EngineConfig (defaults where absent)."""
    import hydra

    node = cfg.strategy.get("engine") if cfg.get("strategy") is not None else None
    if node is None:
        return EngineConfig()
    try:
        engine = hydra.utils.instantiate(node)
    except Exception as err:  # Hydra wraps the constructor's ValueError: surface its one line
        cause = err.__cause__ or err
        raise ConfigError(f"strategy.engine: {str(cause).splitlines()[0]}") from None
    if not isinstance(engine, EngineConfig):
        raise ConfigError(f"strategy.engine gave a {type(engine).__name__}, not an EngineConfig")
    return engine


def workload(cfg: Any, bf16: bool) -> Workload:
    """The micro-batch shape and step of a composed config."""
    data, trainer = cfg.data, cfg.trainer
    seq_len = data.get("seq_len") or data.get("max_length")
    if not seq_len:
        raise ConfigError("data has no seq_len (or max_length): the plan needs the tokens per row")
    for key, value in (("batch_size", data.batch_size), ("seq_len" if data.get("seq_len") else "max_length", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"data.{key}={value!r}: expected a positive integer (e.g. data.{key}=8)")
    return Workload(
        micro_batch=int(data.batch_size),
        seq_len=int(seq_len),
        accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        loss_chunk_tokens=cfg.model.get("loss_chunk_tokens"),
        mlp_chunk_tokens=cfg.model.get("mlp_chunk_tokens"),
        bf16=bf16,
        clip=bool(trainer.get("gradient_clip_val")),
    )


def model_shape(cfg: Any) -> PlanShape:
    from omegaconf import OmegaConf

    from ..models.build import hf_config, meta_model, pretrained_config

    m = cfg.model
    if m.get("pretrained"):
        config = pretrained_config(m.pretrained, weights=False)
    else:  # plain containers: transformers' strict config fields refuse a DictConfig (rope_parameters)
        config = hf_config(OmegaConf.to_container(m.config, resolve=True) if OmegaConf.is_config(m.config) else dict(m.config))
    return PlanShape.of(meta_model(config))


def plan_from_config(cfg: Any, shape: PlanShape | None = None, refuse_device: bool = True, **older: bool) -> Plan:
    """The plan of ``cfg``. ``older``: :class:`~megatrain_lightning.plan.run.Run`'s ``compact_native`` and
    ``head_in_backward`` (what an older engine did, for comparisons with its runs)."""
    hw = resolve_hardware(cfg)
    shape = shape or model_shape(cfg)
    precision = str(cfg.trainer.get("precision") or hw.precision) if cfg.get("trainer") is not None else str(hw.precision)
    work, requested = workload(cfg, precision.startswith("bf16")), engine_config(cfg)
    tried = bool(requested.unset) and hw.accelerator == "cuda"  # the strategy measures and tries its placement
    run = resolve(shape, work, choose_placement(shape, work, requested, hw), hw, tried=tried, **older)
    plan = make_plan(shape, run, hw, model=str(cfg.model.get("name") or "model"), refuse_device=refuse_device)
    return dataclasses.replace(plan, chosen=requested.chosen_with_placement if hw.accelerator == "cuda" else ())
