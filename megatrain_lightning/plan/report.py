"""The planner's table: a one-line verdict first, then bytes by item and seconds by phase."""

from __future__ import annotations

from .experts import plan_note
from .fit import Plan, ways_to_fit
from .memory import GB, GIB
from .placement import placement_line
from .timing import matmul_efficiency


def verdict(plan: Plan) -> str:
    """Fits or not, the predicted step and what bounds it, and what to change when it does not fit, in one line."""
    host = f"host {plan.host_total / GB:,.1f} of {plan.host_available / GB:,.0f} GB"
    gpu = f"GPU {plan.gpu_total / GB:,.1f} of {plan.gpu_available / GB:,.1f} GB"
    fits = "fits" if plan.fits else "does NOT fit"
    line = (f"verdict: {fits} on hardware={plan.hardware} ({host}, {gpu}); predicted {plan.step_s:.3f} s/step, "
            f"{plan.tokens_per_s:,.0f} tokens/s, bound by {plan.bottleneck}")
    ways = ways_to_fit(plan)
    return line + (f"; to fit, any of: {'; '.join(ways)}" if ways else "")


def format_plan(plan: Plan) -> str:
    """The short table the planner prints."""
    s, w, e = plan.shape, plan.run.work, plan.run.engine
    compiled = plan.run.compiled()
    n = s.total_params
    lines = [
        *([plan.picked, ""] if plan.picked else []),
        verdict(plan),
        "",
        *([f"warning: {plan.moe_warning}", ""] if plan.moe_warning else []),
        f"plan: model={plan.model} ({n / 1e9:.3f} B params: {s.layers} blocks of up to {s.largest_block / 1e6:.1f} M, "
        f"{s.resident_params / 1e6:.1f} M resident) on hardware={plan.hardware}",
        *([plan_note(s)] if plan_note(s) else []),
        f"run: micro-batch {w.micro_batch} x seq {w.seq_len}, accumulate {w.accumulate}, loss "
        f"{'chunks of ' + str(w.loss_chunk_tokens) + ' tokens' if w.loss_chunk_tokens else 'unchunked'}, MLP "
        f"{'chunks of ' + str(w.mlp_chunk_tokens) + ' tokens' if w.mlp_chunk_tokens else 'unchunked'}",
        f"engine: slots {e.slots}, keep {e.keep_activations} ({e.kept_saves}), cache {e.cache_weights}, offload inputs "
        f"{e.offload_inputs} ({e.offloaded_blocks(s.layers)} blocks, saved in {e.saved_inputs_dtype} dtype), host state "
        f"{e.host_state}, grad buffers {e.grad_buffers}, bf16 grads {e.bf16_grads}",
        *([placement_line(e, plan.chosen)] if plan.chosen else []),
        "",
        f"{'host memory':<44}{'GB':>10}{'B/param':>10}",
    ]
    for k, v in plan.host.items():
        lines.append(f"  {k:<42}{v / GB:>10.2f}{v / n:>10.2f}")
    lines.append(f"  {'total':<42}{plan.host_total / GB:>10.2f}{plan.host_total / n:>10.2f}"
                 f"   of {plan.host_available / GB:,.0f} GB")
    lines.append(f"  {'pinned (masters, grads, staging)':<42}{plan.pinned / GB:>10.2f}{plan.pinned / n:>10.2f}"
                 f"   {'within' if plan.pinned_ok else 'OVER (pageable copies)'} budget")
    lines += ["", f"{'GPU memory':<44}{'GB':>10}"]
    for k, v in plan.gpu.items():
        lines.append(f"  {k:<42}{v / GB:>10.2f}")
    lines.append(f"  {'peak (lasting + larger transient)':<42}{plan.gpu_total / GB:>10.2f}"
                 f"   of {plan.gpu_available / GB:.1f} GB ({plan.gpu_total / GIB:.1f} GiB)")
    lines += ["", f"{'time per optimizer step':<44}{'s':>10}"]
    for k, v in plan.times.items():
        lines.append(f"  {k:<42}{v:>10.3f}")
    lines += [
        f"  bottleneck: {plan.bottleneck}; {plan.tokens_per_s:,.0f} tokens/s, "
        f"{s.model_flops_per_token(w.seq_len) * plan.tokens_per_s / 1e12:,.0f} model TFLOPS "
        f"(blocks at {matmul_efficiency(s.hidden, compiled):.0%} of {plan.hardware}'s bf16 peak"
        + (", compiled)" if compiled else ")"),
        "",
        f"largest micro-batch at seq {w.seq_len}: {plan.max_micro_batch}; "
        f"largest seq len at micro-batch {w.micro_batch}: {plan.max_seq_len}",
    ]
    if plan.needs_offload is not None and plan.needs_offload != plan.run.engine.offloaded_blocks(s.layers):
        lines.append(f"fits with strategy.engine.offload_inputs={plan.needs_offload} (the fewest offloaded blocks "
                     f"at this shape)")
    lines.append(context_line(plan))
    return "\n".join(lines)


def context_line(plan: Plan) -> str:
    """The longest sequence at the run's micro-batch, offloading as many saved inputs as it must."""
    c, w = plan.longest, plan.run.work
    if c is None:
        return f"longest context at micro-batch {w.micro_batch}: not even 128 tokens fit"
    return (f"longest context at micro-batch {w.micro_batch}: {c.seq_len:,} tokens ({c.seq_len / 1024:,.0f} K) with "
            f"offload_inputs={c.offload} of {c.recomputed} blocks, bounded by {c.limited_by} memory; predicted "
            f"{c.step_s:,.1f} s/step, {c.tokens_per_s:,.0f} tokens/s, {c.model_tflops:,.0f} model TFLOPS")
