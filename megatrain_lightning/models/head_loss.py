"""The LM head and its cross-entropy in chunks of tokens, each chunk's gradients taken in the forward.

With a 150-200 K vocabulary the logits are the largest activation of a step (``[tokens, vocab]`` in fp32:
57 GB at 7B and 16 x 2048 tokens). ``CausalLM(loss_chunk_tokens=N)`` never makes them whole: the head and the
loss run ``N`` tokens at a time. Each chunk's backward runs right after its forward, inside the loss's
forward (the way fused linear cross-entropy kernels do it), so nothing of a chunk outlives it but the
gradients it adds to two buffers: the head input's (``[tokens, hidden]``) and the head weights'. The loss's
backward hands them on, scaled by the gradient it receives. A checkpoint per chunk (what this replaced)
holds the same but runs each chunk's head matmul and log-softmax twice.

Exact: each chunk runs the very ops autograd would (the head module itself, ``F.cross_entropy`` in fp32,
under the caller's autocast); only the order in which chunks add into the weights' gradient differs. On a CUDA
device with half-precision logits (mixed precision) the cross-entropy and its gradient with respect to the
logits are one ``torch.compile``d function instead (``_fused_cross_entropy``: the same fp32 log-softmax, read
from the half-precision logits and written back as their gradient in one pass, where autograd's path writes
and reads fp32 copies of the ``[chunk, vocab]`` logits five times); the head's backward is autograd's. At
Qwen3's head (151,936 words, 16 K tokens) 55.0 instead of 89.1 ms, at GPT-OSS's (201,088, 28 K) 191.9 instead of
257.9 (H100, 2026-12-05, ``recipes/fused_kernels.py --loss-only``). The
weights are differentiated through detached aliases bound in their place (the head's own module, a LoRA
wrapper, a weight tied to the input embedding alike): hooks on the parameters see one gradient, in the
loss's backward, as they would without chunks. Where the head's parameters are not plain tensors held by
``nn.Parameter`` (DeepSpeed ZeRO-3 gathers them only inside the module's forward and reduces their
gradients in its backward hooks; FSDP holds views or DTensors), the chunks are checkpointed instead, each
run again in the backward.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatrain_lightning.data.sft_batch import IGNORE_INDEX

log = logging.getLogger(__name__)


def chunked_head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum over ``hidden``'s rows (``[tokens, hidden]``) of the cross-entropy of ``head(row)`` against
    ``targets`` (``[tokens]``; ``-100``: not counted), ``chunk`` rows at a time."""
    sites = [(m, name) for m in head.modules() for name, t in m._parameters.items()
             if t is not None and t.requires_grad]
    params = [m._parameters[name] for m, name in sites]
    if not torch.is_grad_enabled() or not (hidden.requires_grad or params):
        return sum(_loss(head, h, t) for h, t in zip(hidden.split(chunk), targets.split(chunk)))
    if not _plain_weights(head):
        return sum(checkpoint(partial(_loss, head), h, t, use_reentrant=False)
                   for h, t in zip(hidden.split(chunk), targets.split(chunk)))
    return _GradsInForward.apply(head, sites, hidden, targets, chunk, *params)


def _plain_weights(head: nn.Module) -> bool:
    """Whether every weight ``head`` differentiates is an ``nn.Parameter`` over a plain tensor that no sharding
    engine manages: not one of DeepSpeed's (they carry ``ds_id``), a DTensor, or a tensor attribute that requires
    grad outside ``_parameters`` (FSDP's views of its flat parameter)."""
    for m in head.modules():
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in vars(m).values()):
            return False
        for p in m._parameters.values():
            if p is not None and not (isinstance(p, nn.Parameter) and type(p.data) is torch.Tensor
                                      and not hasattr(p, "ds_id")):
                return False
    return True


def _loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _cross_entropy(head(hidden), targets)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def cross_entropy_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")`` and its gradient with
    respect to ``logits`` (in their dtype), the way autograd computes both: log-softmax in fp32, its backward
    ``exp(log_softmax) - onehot`` on counted rows (ignored rows: zero, whatever their logits)."""
    counted = targets != IGNORE_INDEX
    picked = targets.masked_fill(~counted, 0)[:, None]
    logp = torch.log_softmax(logits.float(), dim=-1)  # the fp32 copy of the logits lives for this line only
    loss = -torch.where(counted, logp.gather(1, picked).squeeze(1), 0.0).sum()
    if torch.compiler.is_compiling():
        # one pass over the chunk: inductor fuses the exp, the one-hot compare and the cast into one kernel
        onehot = torch.arange(logp.shape[1], device=logp.device)[None, :] == picked
        grad = torch.where(onehot, logp.exp() - 1, logp.exp())
    else:
        # run eagerly (dynamo disabled, or fallen back): in place, no [chunk, vocab] buffer beside logp and
        # the result (10 B per logit at the peak, under the 12 the planner counts for autograd's path)
        minus_one = torch.full(picked.shape, -1.0, dtype=logp.dtype, device=logp.device)
        grad = logp.exp_().scatter_add_(1, picked, minus_one)
    return loss, grad.masked_fill_(~counted[:, None], 0.0).to(logits.dtype)


# The devices whose half-precision logits take the compiled cross-entropy (tests add "cpu").
FUSED_DEVICES = ("cuda",)
_fused_cross_entropy: object = None  # the compiled cross_entropy_and_grad; False once compiling it failed


def _fused(logits: torch.Tensor) -> object:
    """The compiled :func:`cross_entropy_and_grad` for ``logits`` (CUDA, half precision), else None."""
    global _fused_cross_entropy
    if logits.device.type not in FUSED_DEVICES or logits.dtype not in (torch.bfloat16, torch.float16) \
            or _fused_cross_entropy is False:
        return None
    if _fused_cross_entropy is None:
        _fused_cross_entropy = torch.compile(cross_entropy_and_grad)
    return _fused_cross_entropy


def _chunk_grads(head: nn.Module, h: torch.Tensor, t: torch.Tensor, wrt: list[torch.Tensor]) -> tuple[Any, Any]:
    """One chunk's summed loss and its gradients with respect to ``wrt`` (its logits live until this returns)."""
    global _fused_cross_entropy
    logits = head(h)
    fused = _fused(logits)
    if fused is not None:
        try:
            loss, grad_logits = fused(logits.detach(), t)  # type: ignore[operator]
        except torch._dynamo.exc.TorchDynamoException as err:  # compiling failed (not the data: those propagate)
            log.warning("torch.compile failed on the loss (%s: %s); its eager path from here on",
                        type(err).__name__, (str(err).splitlines() or [""])[0][:300])
            _fused_cross_entropy = False
        else:
            return loss, torch.autograd.grad(logits, wrt, grad_logits, allow_unused=True)
    loss = _cross_entropy(logits, t)
    return loss, torch.autograd.grad(loss, wrt, allow_unused=True)


class _GradsInForward(torch.autograd.Function):
    """``apply(head, sites, hidden, targets, chunk, *params)`` -> the summed loss; ``params``: the tensors at
    ``sites`` (``(module, name)`` in ``head``) that require grad."""

    @staticmethod
    def forward(ctx: Any, head: nn.Module, sites: list, hidden: torch.Tensor, targets: torch.Tensor, chunk: int,
                *params: torch.Tensor) -> torch.Tensor:
        aliases = [p.detach().requires_grad_() for p in params]
        held = [m._parameters[name] for m, name in sites]
        # Buffers: from here to the loss's backward, which scales them in place and hands them on
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)  # the first chunk's own gradient, then sums
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for (m, name), a in zip(sites, aliases):
            m._parameters[name] = a
        try:
            start = 0
            for h, t in zip(hidden.split(chunk), targets.split(chunk)):
                with torch.enable_grad():
                    h = h.detach().requires_grad_(grad_hidden is not None)
                    wrt = ([h] if grad_hidden is not None else []) + aliases
                    loss, grads = _chunk_grads(head, h, t, wrt)
                if grad_hidden is not None:
                    grad_hidden[start:start + h.shape[0]] = grads[0]
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
                total += loss.detach()
                start += h.shape[0]
        finally:
            for (m, name), p in zip(sites, held):
                m._parameters[name] = p
        ctx.grads = (grad_hidden, [torch.zeros_like(p) if g is None else g for p, g in zip(params, grad_params)])
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad_hidden, grad_params = ctx.grads
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad.to(grad_hidden.dtype))
        for g in grad_params:
            g.mul_(grad.to(g.dtype))
        return (None, None, grad_hidden, None, None, *grad_params)
