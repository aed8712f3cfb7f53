"""The plan of a composed training config (``conf/``), as ``train.py`` would run it: the model on the meta
device only, the hardware profile resolved, the strategy's EngineConfig instantiated and its open placement
fields chosen (``placement.py``)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

from ..config import EngineConfig
from ..errors import ConfigError
from ..hardware import resolve_hardware
from .experts import PICK_FRACTION, pick_micro_batch
from .fit import Plan, make_plan, resolve
from .measured import by_planner, predicted_first_step
from .placement import HEADROOM, choose_placement
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

    from ..models.build import hf_config, meta_model, pretrained_config, route_experts

    m = cfg.model
    if m.get("pretrained"):
        config = pretrained_config(m.pretrained, weights=False)
    else:  # plain containers: transformers' strict config fields refuse a DictConfig (rope_parameters)
        config = hf_config(OmegaConf.to_container(m.config, resolve=True) if OmegaConf.is_config(m.config) else dict(m.config))
    # the experts run as the run's would (CausalLM): whether they compile inside their blocks depends on it
    return PlanShape.of(route_experts(meta_model(config), m.get("experts_implementation")))


def plan_from_config(cfg: Any, shape: PlanShape | None = None, refuse_device: bool = True,
                     from_first_step: bool = False, **older: bool) -> Plan:
    """The plan of ``cfg``. ``from_first_step``: at the placement the strategy will reach from its measured first
    step (``measured.by_planner`` on the step the planner predicts, ``measured.predicted_first_step``) rather
    than the planner's own choice; the strategy's check of that step counts one block's recompute twice, so near
    the device's limit it keeps fewer blocks than the planner would. ``older``:
    :class:`~megatrain_lightning.plan.run.Run`'s ``compact_native`` and ``head_in_backward`` (what an older engine
    did, for comparisons with its runs)."""
    hw = resolve_hardware(cfg)
    shape = shape or model_shape(cfg)
    precision = str(cfg.trainer.get("precision") or hw.precision) if cfg.get("trainer") is not None else str(hw.precision)
    work, requested = workload(cfg, precision.startswith("bf16")), engine_config(cfg)
    tried = bool(requested.unset) and hw.accelerator == "cuda"  # the strategy measures and tries its placement
    if from_first_step and tried:
        engine, _ = by_planner(predicted_first_step(shape, work, requested, hw), requested, shape, work, hw)
    else:
        engine = choose_placement(shape, work, requested, hw)
    run = resolve(shape, work, engine, hw, tried=tried, **older)
    plan = make_plan(shape, run, hw, model=str(cfg.model.get("name") or "model"), refuse_device=refuse_device)
    return dataclasses.replace(plan, chosen=requested.chosen_with_placement if hw.accelerator == "cuda" else ())


def planned_run(cfg: Any, overrides: Sequence[str] = (), refuse_device: bool = True) -> Plan:
    """The plan of ``cfg`` as ``train.py`` runs it: a host too small refused first, then a mixture of experts left
    at the profile's micro-batch given the planner's pick (:func:`moe_micro_batch`, written into
    ``cfg.data.batch_size``; the plan's ``picked`` says so, and its host-bound warning, which named a larger batch
    than the profile's, gives way to it). ``overrides``: the run's command-line overrides."""
    shape = model_shape(cfg)
    plan = plan_from_config(cfg, shape=shape, refuse_device=refuse_device)
    picked = moe_micro_batch(cfg, shape, overrides)
    if picked is None:
        return plan
    cfg.data.batch_size = picked[0]
    return dataclasses.replace(plan_from_config(cfg, shape=shape, refuse_device=refuse_device, from_first_step=True),
                               picked=picked[1], moe_warning=None)


# data.batch_size as the packaged data configs leave it: the hardware profile's micro_batch
PROFILE_MICRO_BATCH = "${hardware.micro_batch}"
# Overrides that set the micro-batch by hand: the pick leaves it
MICRO_BATCH_KEYS = ("data.batch_size", "hardware.micro_batch")


def moe_micro_batch(cfg: Any, shape: PlanShape | None = None, overrides: Sequence[str] = ()) -> tuple[int, str] | None:
    """The micro-batch the planner picks for a mixture of experts, and the line that says so; None where the pick
    does not apply or keeps the hardware profile's micro-batch. ``overrides``: the run's command-line overrides.

    A token passes through a fraction of an MoE's block parameters, while the work per step (the host AdamW,
    the device's update of what it holds, the copies) is on all of them: at the profile's micro-batch that work
    takes a larger share of the step than for a dense model of the same size. The pick
    (:func:`~megatrain_lightning.plan.experts.pick_micro_batch`): the smallest micro-batch whose planned
    tokens/s is within 10% of the best the device holds up to 8x the profile's, each planned at the placement
    the planner would choose for it; a micro-batch above the profile's must fit within the placement's headroom.

    Not picked: a dense model; ``pick_micro_batch=false``; ``data.batch_size`` or ``hardware.micro_batch`` set
    (in the config or in ``overrides``); data without a fixed ``seq_len`` (a fine-tuning set: its batch size is
    part of its recipe); accumulation; a plan for a CPU.
    """
    from omegaconf import OmegaConf

    data = cfg.get("data")
    if (not cfg.get("pick_micro_batch", True) or data is None or data.get("seq_len") is None
            or _raw(data, "batch_size") != PROFILE_MICRO_BATCH
            or any(_key(o) in MICRO_BATCH_KEYS for o in overrides)):
        return None
    hw = resolve_hardware(cfg)
    if hw.accelerator != "cuda" or int(cfg.trainer.get("accumulate_grad_batches") or 1) != 1:
        return None
    shape = shape or model_shape(cfg)
    if shape.active_fraction >= 1.0:
        return None
    base, seq = int(data.batch_size), int(data.seq_len)
    trial = copy.deepcopy(cfg)

    def tokens_per_s(mb: int) -> float | None:
        trial.data.batch_size = mb
        try:
            plan = plan_from_config(trial, shape=shape, refuse_device=False, from_first_step=True)
        except ConfigError:  # e.g. the host refuses a larger micro-batch's buffers: it does not fit
            return None
        room = plan.gpu_available * (1.0 if mb == base else HEADROOM)
        return None if plan.gpu_total > room else mb * seq / plan.step_s

    picked, rates = pick_micro_batch(tokens_per_s, base)
    if picked == base:
        return None
    best = max(rates, key=rates.__getitem__)
    model = str(OmegaConf.select(cfg, "model.name", default=None) or "the model")
    return picked, (
        f"data.batch_size={picked}: the planner's pick for {model}, a mixture of experts ({shape.active_fraction:.0%} of "
        f"its block parameters active per token, the optimizer's work per step on all of them): {picked * seq:,} tokens "
        f"per step, planned at {rates[picked]:,.0f} tokens/s against {rates[base]:,.0f} at hardware={hw.name}'s "
        f"micro-batch of {base} (within {1 - PICK_FRACTION:.0%} of the best the device holds, {rates[best]:,.0f} at "
        f"{best}). Set data.batch_size (or pick_micro_batch=false) to choose it yourself")


def _raw(node: Any, key: str) -> Any:
    """``node[key]`` unresolved (an interpolation as written)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=False).get(key)


def _key(override: str) -> str:
    """The key a command-line override sets (``+a.b=1``, ``~a.b``, ``a.b=1`` -> ``a.b``)."""
    return override.lstrip("+~").split("=", 1)[0]
