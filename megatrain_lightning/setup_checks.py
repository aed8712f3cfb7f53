"""What MegaTrainStrategy checks at setup, before it builds anything.

What it cannot train exactly is refused by name, with the fix (a router loss without transformers 5's
collector, a norm that tracks running statistics, an unknown clipping algorithm); a host store that
cannot fit the memory left is refused with the numbers; and whether anything but the engine may write
the weights between steps (a module hook, a callback) is found, so that the strategy takes back what
such code wrote before the next step.
"""

from __future__ import annotations

import sys
from typing import Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from . import host_memory
from .config import EngineConfig
from .engine.compiled import WHOLE_IMPLEMENTATIONS, experts_of
from .engine.side_outputs import recorder_known
from .errors import ConfigError
from .plan.fit import check_host_at_setup, setup_shape


def check_supported(module: pl.LightningModule, trainer: pl.Trainer) -> None:
    # Router logits (output_router_logits) recorded by hooks inside a block become differentiable
    # outputs of the block (engine/side_outputs.py), through transformers 5's output collector; an
    # older transformers records them otherwise, and its auxiliary loss would carry no gradient.
    fitting = trainer.state.fn == TrainerFn.FITTING
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and getattr(cfg, "output_router_logits", False) and fitting and not recorder_known():
            raise ValueError(
                f"{type(m).__name__} has config.output_router_logits=True, but this transformers does not "
                "record router logits through transformers.utils.output_capturing (transformers 5), the "
                "mechanism MegaTrainStrategy hooks into (engine/side_outputs.py) to give the router "
                "auxiliary loss its gradient through streamed blocks. Upgrade transformers to 5.x, or set "
                "config.output_router_logits=False (router_aux_loss_coef then has no effect)."
            )
        if cfg is not None and fitting:
            refuse_state_across_blocks(type(m).__name__, cfg)
    if fitting:
        refuse_peft_options(module)
        refuse_shared_storage(module)
    sparse = [n for n, m in module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(
            f"MegaTrainStrategy ships dense gradients to its host stores; {', '.join(sparse[:4])} has sparse=True "
            "(sparse gradients). Build it with sparse=False (the default), or train with another strategy.")
    # The host stores hold fp32 (and bf16/fp16 frozen) weights: any other dtype would be cast on the way in.
    odd = [(n, p.dtype) for n, p in module.named_parameters()
           if p.dtype not in (torch.float32, torch.bfloat16, torch.float16)]
    if odd:
        names = ", ".join(f"{n} ({d})" for n, d in odd[:4]) + (f" and {len(odd) - 4} more" if len(odd) > 4 else "")
        raise ValueError(
            f"MegaTrainStrategy keeps parameters in host stores of fp32 (bf16 or fp16 where frozen); {names} would "
            "be cast on the way in (a complex parameter would lose its imaginary part, an integer one become "
            "float). Give them one of those dtypes (a frozen quantized weight as a buffer), or train this "
            "module with another strategy.")
    if trainer.gradient_clip_algorithm is not None and str(trainer.gradient_clip_algorithm) not in (
        "norm", "value", "GradClipAlgorithmType.NORM", "GradClipAlgorithmType.VALUE"
    ):
        raise ValueError(f"unsupported gradient_clip_algorithm {trainer.gradient_clip_algorithm}")


def refuse_state_across_blocks(name: str, config: object) -> None:
    """Hugging Face models whose blocks hand tensors to later blocks, or to their own next call, outside their
    inputs and outputs: a streamed block runs without a graph and is recomputed in the backward, so what it handed
    on would carry no gradient, or the recompute would start from another state. Refused by config at setup (the
    first forward's check, ``engine/first_call.py``, finds them too, a step later)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shared = getattr(text, "num_kv_shared_layers", 0)
    if isinstance(shared, int) and shared > 0:
        raise ValueError(
            f"MegaTrainStrategy cannot train {name} exactly: its last config.num_kv_shared_layers={shared} layers "
            "read the keys and values an earlier layer stored in shared_kv_states, and a streamed layer's stored "
            "keys would reach them without a gradient (its k_proj, v_proj and everything before it would get too "
            "little). Train it with Lightning's default strategy (or FSDP), or build it with "
            "num_kv_shared_layers=0 (a different model).")
    if getattr(text, "model_type", None) == "reformer":
        raise ValueError(
            f"MegaTrainStrategy cannot stream {name}'s layers: its reversible layers (_ReversibleFunction) run without "
            "a graph and rebuild their inputs in their own backward, calling the layers' submodules directly, so no "
            "streamed block call would run (the layers would read their host weights). Train it with Lightning's "
            "default strategy (or FSDP).")
    if getattr(text, "model_type", None) == "recurrent_gemma":
        raise ValueError(
            f"MegaTrainStrategy cannot train {name} exactly: its recurrent blocks keep their state between calls "
            "(temporal_block.conv1d_state, rg_lru.recurrent_states) and start from it, so a streamed block "
            "recomputed in the backward would start from the state its forward left. Train it with Lightning's "
            "default strategy (or FSDP).")


# peft options a streamed block cannot train exactly (peft 0.21): option -> why
_PEFT_OPTIONS = {
    "alora_invocation_tokens": "aLoRA hands each layer its token offsets through forward pre-hooks that live only "
                               "while PeftModel.forward runs, so the backward's recompute would apply the adapter "
                               "to every token",
    "velora_config": "VeLoRA replaces its lora_velora_embed buffers in the forward, and a streamed block's recompute "
                     "starts from the buffers it had",
    "monteclora_config": "MonteCLoRA draws a new noise sample at every forward from a counter outside torch, so the "
                         "backward's recompute would differentiate another sample than the forward's",
    "target_parameters": "LoRA on parameters (ParamWrapper) adds and removes a parametrization around every forward, "
                         "which the strategy's weight binding cannot take part in",
    "coft": "constrained OFT projects oft_R onto its constraint set in place in every forward, and a streamed block's "
            "weights are written only by the optimizer",
}
# peft methods a streamed block cannot train exactly (peft 0.21, 0.22): peft_type -> why
_PEFT_TYPES = {
    "POLY": "Poly hands each layer its task_ids through forward pre-hooks that live only while PeftModel.forward runs, "
            "so the backward's recompute would run the router without them",
    "XLORA": "X-LoRA hands its classifier's scalings to every LoRA layer through forward pre-hooks that live only while "
             "the model's forward runs, so the backward's recompute would run the layers without them (its classifier "
             "trained silently wrong)",
}


def refuse_peft_options(module: pl.LightningModule) -> None:
    """peft adapters with an option listed in ``_PEFT_OPTIONS``: refused by adapter and option, with the fix.
    Found by sweeps of peft 0.21's and 0.22's methods (2026-12-05, 2026-12-07): aLoRA, MonteCLoRA and X-LoRA trained
    silently wrong, VeLoRA lost its buffers, ``target_parameters`` and Poly failed in the first backward, OFT's
    ``coft`` was refused in the first forward naming every weight. Methods in ``_PEFT_TYPES`` are refused whatever
    their options."""
    for m in module.modules():
        configs = getattr(m, "peft_config", None)
        if not isinstance(configs, dict):
            continue
        for adapter, cfg in configs.items():
            kind = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "")))
            if kind in _PEFT_TYPES:
                raise ValueError(
                    f"MegaTrainStrategy cannot train {type(m).__name__}'s adapter {adapter!r} exactly: it is a "
                    f"{type(cfg).__name__}, and {_PEFT_TYPES[kind]}. Train another adapter method (LoRA trains "
                    "exactly), or with Lightning's default strategy.")
            for option, why in _PEFT_OPTIONS.items():
                if getattr(cfg, option, None):
                    raise ValueError(
                        f"MegaTrainStrategy cannot train {type(m).__name__}'s adapter {adapter!r} exactly: its "
                        f"{type(cfg).__name__} sets {option}, and {why}. Train it without {option} (plain LoRA "
                        "trains exactly), or with Lightning's default strategy.")


def refuse_shared_storage(module: pl.LightningModule) -> None:
    """Distinct parameters whose memory overlaps (peft's LoRA on a tied embedding with ``ensure_weight_tying=True``:
    ``lm_head.lora_A`` is the transpose of ``embed_tokens.lora_embedding_B``): the host stores hold each parameter
    in its own place, which would untie them silently. One parameter object used twice (tied weights) is fine, and
    so are disjoint views of one buffer (the strategy's own stores, on a second fit)."""
    spans = []
    for name, p in module.named_parameters():  # each object once
        if p.is_meta or p.numel() == 0:
            continue
        start = p.data_ptr()
        last = sum((n - 1) * st for n, st in zip(p.shape, p.stride()))  # the farthest element, in elements
        spans.append((p.device, start, start + (last + 1) * p.element_size(), name))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for (dev, _, end, first), (dev2, start, _, second) in zip(spans, spans[1:]):
        if dev == dev2 and start < end:
            raise ValueError(
                f"MegaTrainStrategy cannot train {first} and {second} exactly: they are two parameters on the same "
                "memory (one a view of the other: peft's ensure_weight_tying=True on a tied embedding makes "
                "lm_head's LoRA the transpose of the embedding's), and the strategy keeps each parameter in its own "
                "place, which would untie them. Tie them as one parameter object, leave the embedding out of "
                "target_modules (or ensure_weight_tying=False), or train with Lightning's default strategy.")


def refuse_grad_hooks(blocks: Sequence[tuple[str, torch.nn.Module]]) -> None:
    """A gradient hook on a block's parameter (``register_hook``, ``register_post_accumulate_grad_hook``; peft's
    OSF) would not run: a streamed block's gradients reach the host without autograd on the parameter. Refused at
    setup (the first forward's check, ``engine/first_call.py``, finds hooks added later)."""
    for block_name, block in blocks:
        for name, p in block.named_parameters():
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                raise ValueError(
                    f"MegaTrainStrategy cannot train {block_name}.{name} exactly: it has a gradient hook "
                    "(register_hook or register_post_accumulate_grad_hook, as peft's OSF registers), and a streamed "
                    "block's gradients reach the host accumulator without autograd on the parameter, so the hook "
                    "would not run. Read or change the gradients in on_before_optimizer_step, or train with "
                    "Lightning's default strategy.")


def experts_hint(module: pl.LightningModule) -> str | None:
    """A line for a Hugging Face mixture of experts on transformers' ``grouped_mm`` experts: the package's
    ``grouped_mm_gather`` is the same function with a backward of gathers (``models/expert_routing.py``;
    on the H200 a GPT-OSS-20B layer 93.7 against 114.2 ms). None where it does not apply."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_experts_implementation", None) == "grouped_mm" and hasattr(m, "set_experts_implementation") \
                and any(hasattr(e, "is_concatenated") for e in m.modules()):
            return (f"{type(m).__name__} runs its experts with experts_implementation='grouped_mm', whose backward "
                    "scatters rows with index_put (slow on CUDA); `import megatrain_lightning.models` and "
                    "model.set_experts_implementation('grouped_mm_gather') runs the same function with a backward of "
                    "gathers (megatrain_lightning/models/expert_routing.py)")
    return None


def experts_in_bf16(module: pl.LightningModule, precision: str) -> str | None:
    """A warning for a Hugging Face mixture of experts on transformers' grouped GEMM experts under bf16-mixed: they
    cast the tokens to the experts' weights' dtype (torch's grouped GEMM is not on autocast's list), fp32 under
    Lightning's own bf16-mixed and bf16 here, where the weights are bf16 on the device (held in fp32, the experts'
    GEMMs, most of an MoE's work, would run in fp32: ``engine/wide_weights.py``). None where it does not apply."""
    if precision != "bf16-mixed":
        return None
    grouped = sorted({type(e).__name__ for e in experts_of(module)  # fp32 weights (bf16 ones read the same bits)
                      if getattr(getattr(e, "config", None), "_experts_implementation", None) in WHOLE_IMPLEMENTATIONS
                      and any(p.dtype == torch.float32 and p.dim() >= 2 for p in e.parameters())})
    if not grouped:
        return None
    return (f"MegaTrainStrategy: {', '.join(grouped)} compute their grouped GEMMs in bf16 under bf16-mixed, where "
            "Lightning's own bf16-mixed computes them in fp32 (transformers casts the tokens to the experts' fp32 "
            "weights; torch's grouped GEMM is not on autocast's list): the two runs' losses part in the fifth digit "
            "within steps (Mixtral, 3 steps: 4.7e-5). For Lightning's numbers bit for bit, use "
            "experts_implementation='eager' (slower) or precision='32-true'.")


def in_place_expert_bias(module: pl.LightningModule) -> str | None:
    """The class of a Hugging Face experts module whose implementation adds its bias into the grouped_mm output in
    place (transformers' ``grouped_mm`` and ``batched_mm`` with ``has_bias``: GPT-OSS), which a selective recompute
    saving matmul outputs (``kept_saves="matmuls"``) refuses at the first backward; None where there is none."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if getattr(m, "has_bias", False) and hasattr(m, "is_concatenated") \
                and getattr(cfg, "_experts_implementation", None) in ("grouped_mm", "batched_mm"):
            return type(m).__name__
    return None


def unseen_in_place_kernels(module: pl.LightningModule) -> str | None:
    """Parts of ``module`` patched by Liger Kernel (its fused RMSNorm, SwiGLU and rotary embedding, applied by
    ``apply_liger_kernel_to_*`` or ``AutoLigerKernelForCausalLM``), named; None where there are none. Their
    Triton kernels write into tensors in place (the rotary embedding into the projections' outputs, the SwiGLU's
    backward into its saved inputs) where autograd's version counters cannot see it, so torch's selective
    recompute (``kept_saves="matmuls"``) hands the backward matmul outputs they have changed: on a Qwen2.5-7B
    layer in bf16 the gradients came out 1.44 (relative) away from the eager ones (H200, 2026-12-04,
    ``recipes/fused_kernels.py``), silently. Keeping every activation is exact."""
    def liger(fn: object) -> bool:  # its fused linear cross-entropy (a *ForCausalLM's forward) is no block kernel
        where = getattr(fn, "__module__", None) or ""
        return where.startswith("liger_kernel") and not where.startswith("liger_kernel.transformers.model.")

    found: list[str] = []
    for m in module.modules():
        bound = m.__dict__.get("forward")
        for fn in (type(m).forward, getattr(bound, "__func__", bound)):
            if liger(fn) and type(m).__name__ not in found:
                found.append(type(m).__name__)
        home = sys.modules.get(type(m).__module__)
        rope = getattr(home, "apply_rotary_pos_emb", None)
        name = f"{getattr(home, '__name__', '')}.apply_rotary_pos_emb"
        if liger(rope) and name not in found:
            found.append(name)
    return ", ".join(found) + " (Liger Kernel)" if found else None


def refuse_running_statistics(blocks: Sequence[tuple[str, torch.nn.Module]]) -> None:
    """A norm that tracks running statistics updates them in its forward, which a streamed block runs
    twice per step (once more in the backward's recompute): refused by name, with the fix."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    for block_name, block in blocks:
        for name, m in block.named_modules():
            if isinstance(m, (_BatchNorm, _InstanceNorm)) and m.track_running_stats:
                path = f"{block_name}.{name}" if name else block_name
                raise ValueError(
                    f"MegaTrainStrategy cannot train {path} ({type(m).__name__}) exactly: it updates running "
                    "statistics in its forward, and a streamed block runs its forward twice per step (once more "
                    "in the backward's recompute). Use track_running_stats=False, a LayerNorm or GroupNorm, or "
                    "stream another level (MegaTrainStrategy(block_class=...)) that keeps the norm resident."
                )


def host_memory_refusal(module: pl.LightningModule, blocks: Sequence[torch.nn.Module], config: EngineConfig,
                        trainer: pl.Trainer, ranks_per_node: int = 1,
                        tmpfs: tuple[str, float] | None = None) -> str | None:
    """Why the host store of ``module`` cannot fit the memory this process may still take (MemAvailable,
    capped by a cgroup limit or ``ulimit -v``), in one paragraph with the numbers and the fix; None when it
    fits. Under data parallel (``ranks_per_node`` > 1) the node's one shared store and the tmpfs it lives
    in (``tmpfs``: its directory and free bytes) are checked too."""
    params = {id(p): p for p in module.parameters()}
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    # fp32 parameters that already exist on the host become views of the store: their memory is released
    released = sum(p.numel() * p.element_size() for p in params.values() if not p.is_meta)
    limit, vm = host_memory.cgroup_limit(), host_memory.address_space_headroom()
    note = f"MemAvailable {host_memory.meminfo_available() / 1e9:,.1f} GB" + (
        f", cgroup limit {limit[0] / 1e9:,.1f} GB with {limit[1] / 1e9:,.1f} GB in use" if limit else "") + (
        f", {vm / 1e9:,.1f} GB of address space left under ulimit -v" if vm is not None else "")
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    frozen_bytes = sum(p.numel() * p.element_size() for p in params.values() if not p.requires_grad)
    shape = setup_shape(sum(p.numel() for p in params.values()), sizes, trainable, frozen_bytes)
    try:
        check_host_at_setup(type(module).__name__, shape, config, int(trainer.accumulate_grad_batches),
                            bool(trainer.gradient_clip_val), released, host_memory.available_bytes(), note,
                            ranks_per_node=ranks_per_node, tmpfs=tmpfs)
    except ConfigError as e:
        return str(e)
    return None


# Hooks that run before any training step, or never between two of them: everything else may run while
# a step's host updates are still running on (``overlap_next_forward``).
_BEFORE_TRAINING = {"on_fit_start", "on_sanity_check_start", "on_sanity_check_end", "on_train_start",
                    "on_exception", "on_load_checkpoint", "on_gpu"}
# (on_after_backward and on_before_optimizer_step already turn the overlap itself off)
_MODULE_HOOKS_BETWEEN_STEPS = tuple(
    n for n in dir(pl.LightningModule) if n.startswith("on_") and n not in _BEFORE_TRAINING
    and n not in ("on_before_batch_transfer", "on_after_batch_transfer")  # batches, not weights
)
_CALLBACK_HOOKS_BETWEEN_STEPS = tuple(n for n in dir(pl.Callback) if n.startswith("on_") and n not in _BEFORE_TRAINING)


_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")


def gradient_readers(module: pl.LightningModule, trainer: pl.Trainer) -> list[str]:
    """The module's and callbacks' hooks that see the gradients (``p.grad``) between the backward and the step:
    under data parallel each rank holds only its own stores' (see the strategy's setup warning)."""
    found = [f"{type(module).__name__}.{h}" for h in _GRADIENT_HOOKS if is_overridden(h, module)]
    for cb in trainer.callbacks:
        found += [f"{type(cb).__name__}.{h}" for h in _GRADIENT_HOOKS[:2] if is_overridden(h, cb, pl.Callback)]
    return found


def writers_between_steps(module: pl.LightningModule, trainer: pl.Trainer) -> bool:
    """Whether a hook of the module, or a callback not known to leave the weights alone, runs between
    steps (it may write the weights: an EMA swap, a ``p.data.copy_``, ``load_state_dict``). A module or
    callback declares ``megatrain_reads_weights = False`` when its hooks neither read nor write them (nor the
    optimizer's state, which the updates running on between steps use)."""
    if module_hooks_touch_weights(module):
        return True
    return not all(leaves_weights_alone(cb) for cb in trainer.callbacks)


def module_hooks_touch_weights(module: pl.LightningModule) -> bool:
    """Whether the module overrides a hook that runs between steps, and does not declare
    ``megatrain_reads_weights = False`` (its hooks neither read nor write the weights)."""
    if getattr(module, "megatrain_reads_weights", None) is False:
        return False
    return any(is_overridden(h, module) for h in _MODULE_HOOKS_BETWEEN_STEPS)


def leaves_weights_alone(callback: pl.Callback) -> bool:
    """Whether ``callback`` cannot see half-updated weights between steps: it says so, it is one of ours
    or a Lightning callback that reads none (checkpointing reads them through the strategy, which waits),
    or it hooks nothing between steps."""
    from lightning.pytorch import callbacks as cbs

    declared = getattr(callback, "megatrain_reads_weights", None)
    if declared is not None:
        return not declared
    if type(callback).__module__.startswith("megatrain_lightning."):
        return True
    known = (cbs.TQDMProgressBar, cbs.RichProgressBar, cbs.ModelCheckpoint, cbs.LearningRateMonitor, cbs.Timer,
             cbs.ModelSummary, cbs.RichModelSummary, cbs.EarlyStopping, cbs.ThroughputMonitor)
    if type(callback) in known:
        return True
    return not any(is_overridden(h, callback, pl.Callback) for h in _CALLBACK_HOOKS_BETWEEN_STEPS)
