"""The memory plan: will a model's training state fit, decided before anything is allocated.

MegaTrainStrategy (and the CPU-offload baselines) keep all training state in host memory: an fp32
master weight, an fp32 gradient and AdamW's two fp32 moments, 16 bytes per parameter; the weights
stream to the device from the fp32 masters themselves (cast to bf16 there), so there is no separate
transfer copy. Activations, the
device slots and the Python process itself come on top, so a model that passes this check can
still be too big; one that fails it certainly is, and failing here costs seconds instead of the
minutes of allocating 1 TB before the out-of-memory killer strikes.
"""

from __future__ import annotations

import dataclasses

from megatrain_lightning.errors import ConfigError

GB = 1e9  # decimal gigabytes, as memory is sold and as hardware profiles state it

STATE_BYTES_PER_PARAM = 16  # fp32 master + fp32 gradient + AdamW exp_avg + exp_avg_sq
# strategy.host_state=compact: the fp32 master as bf16 + int16 halves (4), fp32 gradient (4), bf16 moments (4)
COMPACT_STATE_BYTES_PER_PARAM = 12
TRANSFER_BYTES_PER_PARAM = 0  # no host transfer copy: fp32 masters are copied, the device casts
# Measured (recipes/results/2026-11-30-h200-throughput.md): Qwen2.5-7B shape, 7.616 B params, peak host
# RSS 123.2 GiB = 132 GB against 16 B/param = 122 GB of state: the rest is the process and staging.
PINNED_BYTES_PER_PARAM = 8  # fp32 masters and gradient buffers, which MegaTrainStrategy pins


def estimate_host_bytes(
    num_params: int,
    state_bytes_per_param: int = STATE_BYTES_PER_PARAM,
    transfer_bytes_per_param: int = TRANSFER_BYTES_PER_PARAM,
) -> int:
    """Host bytes of training state for `num_params` parameters (activations not included)."""
    return num_params * (state_bytes_per_param + transfer_bytes_per_param)


def state_bytes_per_param(host_state: str | None, pooled_grads: bool = False) -> int:
    """Host bytes per parameter of training state for a strategy's ``host_state`` (None: not MegaTrain's).

    ``pooled_grads``: MegaTrainStrategy lends its blocks pooled gradient buffers (``grad_buffers`` > 0,
    no accumulation, no clipping), so the 4 B/param fp32 gradient is not lasting state; the pool and the
    resident part's gradient are left to the planner, this check stays a lower bound.
    """
    per_param = COMPACT_STATE_BYTES_PER_PARAM if host_state == "compact" else STATE_BYTES_PER_PARAM
    return per_param - (4 if pooled_grads else 0)


def state_description(host_state: str | None, pooled_grads: bool = False) -> str:
    """What :func:`state_bytes_per_param` counts, in words, for the fit check's message."""
    base = ("compact master (bf16 + int16 halves), {grad}2 bf16 AdamW moments" if host_state == "compact"
            else "fp32 master, {grad}2 AdamW moments")
    return base.format(grad="" if pooled_grads else "fp32 gradient, ") + (
        "; gradients in pooled block buffers" if pooled_grads else "")


def check_fits(
    num_params: int,
    host_memory_gb: float,
    model: str = "the model",
    hardware: str = "this hardware",
    state_bytes: int = STATE_BYTES_PER_PARAM,
    what: str | None = None,
) -> int:
    """Raise ConfigError, with the numbers and what to change, when the state cannot fit host memory.

    ``what`` names the state in the message (default: from ``state_bytes``, see :func:`state_description`).

    Returns the estimate in bytes when it fits.
    """
    need = estimate_host_bytes(num_params, state_bytes)
    have = host_memory_gb * GB
    if need > have:
        what = what or ("fp32 master, gradient and 2 AdamW moments" if state_bytes == STATE_BYTES_PER_PARAM
                        else "compact master, fp32 gradient and 2 bf16 AdamW moments")
        raise ConfigError(
            f"model={model} has {_count(num_params)} parameters, whose training state needs "
            f"{_gb(need / GB)} GB of host memory ({state_bytes} B/param: {what}), but hardware={hardware} "
            f"has {_gb(host_memory_gb)} GB: choose a smaller model, a hardware profile with more host memory, "
            f"or set hardware.host_memory_gb if the profile is wrong for this machine"
        )
    return need


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _gb(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def device_state_warning(num_params: int, device_memory_gb: float, strategy: str) -> str | None:
    """For a strategy that keeps all training state on the device: a warning when it cannot fit.

    Not an error: the sweep is where one finds out, and its table records the out-of-memory.
    """
    need = num_params * STATE_BYTES_PER_PARAM
    if need <= device_memory_gb * GB:
        return None
    return (
        f"strategy={strategy} keeps {STATE_BYTES_PER_PARAM} B/param of training state on the device: "
        f"{_gb(need / GB)} GB > {_gb(device_memory_gb)} GB of device memory; expect an out-of-memory error"
    )


def pin_memory_fits(num_params: int, pinned_budget_gb: float) -> bool:
    """Whether the buffers MegaTrainStrategy pins stay within the profile's pinned-memory budget.

    Pinned (page-locked) memory copies 8x faster than pageable (DESIGN.md §2) but cannot be swapped
    or reclaimed, and pinning too much starves the rest of the machine.
    """
    return num_params * PINNED_BYTES_PER_PARAM <= pinned_budget_gb * GB


def main(argv: list[str] | None = None) -> int:
    """`python -m megatrain_lightning.plan model=... hardware=... [key=value ...]`: print the plan.

    Composes the training config from conf/ (as train.py would; `data=synthetic` unless a data option
    is given, so `data.batch_size` and `data.seq_len` are the micro-batch shape) and prints the
    planner's table (megatrain_lightning.planner). Exit 2 with one line when it does not fit.
    """
    import sys
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    args = list(sys.argv[1:] if argv is None else argv)
    conf = Path(__file__).resolve().parent.parent / "conf"
    overrides = ([] if any(a.startswith("data=") for a in args) else ["data=synthetic"]) + args
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        print(_format(plan_from_config(cfg)))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except MissingMandatoryValue as err:
        print(f"error: {err.full_key} must be set, e.g. python -m megatrain_lightning.plan {err.full_key}=...",
              file=sys.stderr)
        return 2
    except (OmegaConfBaseException, ValueError) as err:  # a bad override: Hydra's own one-line reason
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def plan_from_config(cfg, **run_changes):  # noqa: ANN001, ANN003, ANN201 (DictConfig in, planner.Plan out)
    """The plan of a composed training config (the model built on the meta device only). ``run_changes``:
    RunSettings fields to override (what an older engine did, for comparisons with its runs)."""
    from megatrain_lightning.cli import resolve_hardware
    from megatrain_lightning.models.build import hf_config, meta_model, pretrained_config
    from megatrain_lightning.planner import PlanShape, RunSettings, make_plan

    hw = resolve_hardware(cfg)
    m = cfg.model
    config = pretrained_config(m.pretrained) if m.get("pretrained") else hf_config(dict(m.config))
    shape = PlanShape.of(meta_model(config))
    data = cfg.data
    seq_len = data.get("seq_len") or data.get("max_length")
    run = RunSettings(
        micro_batch=int(data.batch_size),
        seq_len=int(seq_len),
        accumulate=int(cfg.trainer.get("accumulate_grad_batches") or 1),
        slots=int(cfg.strategy.get("slots") or hw.slots),
        loss_chunk_tokens=m.get("loss_chunk_tokens"),
        bf16=str(hw.precision).startswith("bf16"),
        compact_state=cfg.strategy.get("host_state") == "compact",
        # None (the strategy's default): on where the one-pass kernel builds, assumed of the target
        bf16_grads=bool(True if cfg.strategy.get("bf16_grads") is None else cfg.strategy.get("bf16_grads")),
        split_embedding=bool(cfg.strategy.get("split_embedding_update", False)),
        keep_activations=int(cfg.strategy.get("keep_activations") or 0),
        kept_saves_matmuls=cfg.strategy.get("kept_saves", "all") == "matmuls",
        cache_weights=int(cfg.strategy.get("cache_weights") or 0),
        offload_inputs=bool(cfg.strategy.get("offload_inputs") or False),
        grad_buffers=int(cfg.strategy.get("grad_buffers") if cfg.strategy.get("grad_buffers") is not None else 0),
        clip=bool(cfg.trainer.get("gradient_clip_val")),
        run_on=bool(cfg.strategy.get("overlap_optimizer", True)) and bool(cfg.strategy.get("overlap_next_forward", True)),
    )
    if cfg.strategy.get("grad_buffers") is None and "grad_buffers" not in run_changes:
        # automatic, as the strategy decides it: own accumulators when they fit the host, else a pool of 4
        from megatrain_lightning.planner import host_bytes

        if sum(host_bytes(shape, run).values()) > hw.host_memory_gb * 1e9 * 0.9:
            run = dataclasses.replace(run, grad_buffers=4)
    run = dataclasses.replace(run, **run_changes)
    return make_plan(shape, run, hw, model=str(m.get("name") or "model"))


def _format(plan) -> str:  # noqa: ANN001
    from megatrain_lightning.planner import format_plan

    return format_plan(plan)


if __name__ == "__main__":
    raise SystemExit(main())
