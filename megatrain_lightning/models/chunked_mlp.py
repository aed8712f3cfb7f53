"""Sequence-chunked MLP ("chunked MLP execution"): each decoder layer's position-wise MLP run over chunks of
tokens, so that its wide intermediate activations exist for one chunk at a time.

At long context the MLP's intermediates dominate a layer's working set: for its backward a SwiGLU MLP
keeps gate, up, activation and product (8 x intermediate bytes per token in bf16: at Qwen2.5-7B and 256 K
tokens 40 GB, against 3.8 GB for the layer's fp32 input), and the backward adds about 20 GB of their
gradients. Chunked, the MLP saves only its input (the norm's output) and, in the backward, recomputes and
differentiates one chunk at a time: the intermediates then cost ``chunk_tokens`` rows, independent of the
sequence length.

The norm before the MLP is position-wise too: where a layer's forward feeds ``post_attention_layernorm``'s
output straight into ``mlp`` and nowhere else (Llama, Qwen2/3, Mistral, Phi-3 decoder layers: read off the
forward's source), the norm runs inside the chunks as well, so that its fp32 normalisation and output (8 B x
hidden per token) are not kept either; the chunks then save the residual stream, which is alive anyway.

What it costs: one more forward of the MLP per backward (2 x its parameters in FLOPs per token: at 7B,
+22% of a layer's matmul FLOPs and a few percent of its time at 128 K+ tokens, where attention dominates),
one fp32 accumulator of the MLP's weight gradients during its backward (4 B per MLP parameter: 0.8 GB at
7B), and the MLP's input kept in its own dtype (fp32 under bf16 autocast: 4 B x hidden per token).
Exact: the MLP is position-wise, so every row sees the same arithmetic; only the sums over tokens of the
weight gradients are added chunk by chunk (in fp32: fp32 parity 1e-5 against the unchunked module).
Sequences of at most ``chunk_tokens`` tokens run the MLP as it is.

Model code, not engine code: it works under any strategy. Under MegaTrainStrategy the engine's forward
runs blocks without grad (the chunks run one after another and nothing is kept), its recompute builds the
graph through this Function, and its backward reaches :meth:`_ChunkedMLP.backward`; the weights used are
the ones bound when the MLP ran (the device slot), saved with the input.
"""

from __future__ import annotations

import inspect
import re
import types
from typing import Any

import torch
from torch import nn

from megatrain_lightning.engine.block import RecomputeState
from megatrain_lightning.errors import ConfigError

# A chunked MLP's settings, in its instance __dict__ (not submodules: the state_dict is unchanged). The
# forwards are bound methods of module-level functions, so that copy.deepcopy and pickle follow the module.
_CHUNK, _NORM = "_megatrain_mlp_chunk", "_megatrain_mlp_norm"


def chunk_mlp(model: nn.Module, chunk_tokens: int | None, fold_norm: bool = True) -> int:
    """Run the ``mlp`` of every decoder layer of ``model`` over chunks of ``chunk_tokens`` tokens (None: as
    it is again), with the norm before it where the layer's forward allows (``fold_norm``, see
    :func:`folded_norm`). Returns how many MLPs were changed. The layers are the blocks MegaTrainStrategy
    streams (``blocks.find_blocks``); a ConfigError when none has an ``mlp`` submodule."""
    from megatrain_lightning.blocks import find_blocks

    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ConfigError(f"mlp_chunk_tokens={chunk_tokens!r}: a number of tokens >= 1, or None")
    blocks = [block for _, block in find_blocks(model) if isinstance(getattr(block, "mlp", None), nn.Module)]
    if not blocks:
        raise ConfigError(f"mlp_chunk_tokens: the blocks of {type(model).__name__} have no `mlp` submodule to chunk")
    for block in blocks:
        mlp, norm = block.mlp, folded_norm(block) if fold_norm else None
        for module in (mlp, getattr(block, "post_attention_layernorm", None)):
            if isinstance(module, nn.Module):  # as it was (a norm folded before, say)
                for key in ("forward", _CHUNK, _NORM):
                    module.__dict__.pop(key, None)
        if chunk_tokens is None:
            continue
        mlp.__dict__[_CHUNK], mlp.__dict__[_NORM] = chunk_tokens, norm
        if norm is not None:
            norm.forward = types.MethodType(_passes_through, norm)  # type: ignore[method-assign]  # runs in the chunks
        mlp.forward = types.MethodType(_chunked_forward, mlp)  # type: ignore[method-assign]
    return len(blocks)


# `h = self.post_attention_layernorm(h)` followed at once by `h = self.mlp(h)`: the norm's output reaches
# the MLP only (the name is rebound on the next line).
_NORM_THEN_MLP = re.compile(r"(\w+) = self\.post_attention_layernorm\(\1\)\s*\n\s*\1 = self\.mlp\(\1\)\s*\n")


def folded_norm(block: nn.Module) -> nn.Module | None:
    """The block's ``post_attention_layernorm`` when its forward's source feeds that norm's output straight
    into ``mlp`` and uses the norm nowhere else (then the norm can run inside the MLP's chunks); else None."""
    norm = getattr(block, "post_attention_layernorm", None)
    if not isinstance(norm, nn.Module) or list(norm.children()):
        return None
    try:
        source = inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        return None
    if source.count("post_attention_layernorm") != 1 or not _NORM_THEN_MLP.search(source):
        return None
    return norm


def _passes_through(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x  # a folded norm: the chunked MLP after it applies it, chunk by chunk


def _sites(modules: list[nn.Module], kind: str) -> list[tuple[nn.Module, str]]:
    return [(m, n) for m in modules for n, t in getattr(m, kind).items() if t is not None]


def _chunked_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A chunked MLP's forward (``self``: the MLP); the folded norm first, if any."""
    chunk, norm = self.__dict__[_CHUNK], self.__dict__[_NORM]
    rows = x.numel() // max(x.shape[-1], 1)
    if args or kwargs or x.dim() < 2 or rows <= chunk:
        return type(self).forward(self, type(norm).forward(norm, x) if norm is not None else x, *args, **kwargs)
    modules = [*(norm.modules() if norm is not None else []), *self.modules()]
    run = _Run(self, _sites(modules, "_parameters"), _sites(modules, "_buffers"), chunk, norm)
    weights = [m._parameters[n] for m, n in run.sites]  # what is bound now (a device slot under the engine)
    if not torch.is_grad_enabled() or not (x.requires_grad or any(w.requires_grad for w in weights)):
        with torch.no_grad():
            return run.forward(x)  # nothing to differentiate: the chunks run, nothing is kept
    return _ChunkedMLP.apply(run, x, *weights)


class _Run:
    """One chunked call: how to run the MLP on a chunk with given weights, and the state to replay."""

    def __init__(self, mlp: nn.Module, sites: list, buffer_sites: list, chunk: int, norm: nn.Module | None) -> None:
        self.mlp, self.sites, self.buffer_sites, self.chunk, self.norm = mlp, sites, buffer_sites, chunk, norm
        self.buffers = [m._buffers[n] for m, n in buffer_sites]  # bound now (the engine's device copies)

    def chunks(self, x: torch.Tensor) -> tuple[torch.Tensor, list[slice]]:
        flat = x.reshape(-1, x.shape[-1])  # [rows, hidden]: a view when x is contiguous
        return flat, [slice(i, min(i + self.chunk, flat.shape[0])) for i in range(0, flat.shape[0], self.chunk)]

    def call(self, xc: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The MLP's own forward (after the folded norm's) on rows ``xc``, shaped as ``like`` with one row
        dimension: [1, ..., c, hidden]."""
        z = xc.view(*([1] * (like.dim() - 2)), *xc.shape)
        if self.norm is not None:
            z = type(self.norm).forward(self.norm, z)
        out = type(self.mlp).forward(self.mlp, z)
        if not isinstance(out, torch.Tensor):
            raise ConfigError(
                f"mlp_chunk_tokens: {type(self.mlp).__name__}.forward returns a {type(out).__name__}, not one tensor; "
                "only an MLP that maps each token's hidden state to one output can be chunked (a mixture of experts "
                "that also returns router logits cannot): set mlp_chunk_tokens=null for this model")
        return out.reshape(xc.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat, spans = self.chunks(x)
        out: torch.Tensor | None = None
        for span in spans:
            y = self.call(flat[span], x)  # buffer lifetime: the chunk's intermediates are freed here
            if out is None:
                out = y.new_empty(flat.shape[0], y.shape[-1])  # [rows, out features]
            out[span] = y
        assert out is not None
        return out.view(*x.shape[:-1], out.shape[-1])

    def bound(self, weights: list[torch.Tensor]) -> "_Bound":
        return _Bound(self, weights)


class _Bound:
    """The MLP's parameters (and buffers) replaced by given tensors for a recompute, restored after."""

    def __init__(self, run: _Run, weights: list[torch.Tensor]) -> None:
        self.run, self.weights = run, weights

    def __enter__(self) -> None:
        self.saved = [m._parameters[n] for m, n in self.run.sites]
        self.saved_buffers = [m._buffers[n] for m, n in self.run.buffer_sites]
        for (m, n), w in zip(self.run.sites, self.weights):
            m._parameters[n] = w  # type: ignore[assignment]
        for (m, n), b in zip(self.run.buffer_sites, self.run.buffers):
            m._buffers[n] = b

    def __exit__(self, *exc: Any) -> None:
        for (m, n), w in zip(self.run.sites, self.saved):
            m._parameters[n] = w
        for (m, n), b in zip(self.run.buffer_sites, self.saved_buffers):
            m._buffers[n] = b


class _ChunkedMLP(torch.autograd.Function):
    """``apply(run, x, *weights)`` -> the MLP's output; saves ``x`` and the weights only."""

    @staticmethod
    def forward(ctx: Any, run: _Run, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        # the backward runs outside the forward's autocast region; dropout inside the MLP draws the same
        # masks: the chunks are recomputed in the forward's order from the forward's RNG state
        ctx.replay = RecomputeState(x.device)
        ctx.save_for_backward(x, *weights)  # x: the MLP's input, alive until this backward
        return run.forward(x)  # grad is off in a Function's forward: each chunk's intermediates are freed

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        run: _Run = ctx.run
        x, *weights = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[1], list(ctx.needs_input_grad[2:])
        flat, spans = run.chunks(x)
        grads = grad_out.reshape(flat.shape[0], -1)  # [rows, out features]
        grad_x = torch.empty_like(flat) if need_x else None
        # fp32 sums of the weight gradients over the chunks, cast to each weight's dtype at the end
        acc: list[torch.Tensor | None] = [None] * len(weights)
        leaves = [w.detach().requires_grad_(n) for w, n in zip(weights, need_w)]
        targets = [w for w, n in zip(leaves, need_w) if n]
        with torch.enable_grad(), ctx.replay.replay(), run.bound(leaves):
            for span in spans:
                xc = flat[span].detach().requires_grad_(need_x)
                y = run.call(xc, x)  # the chunk's graph lives until its gradients are taken
                got = torch.autograd.grad(y, ([xc] if need_x else []) + targets, grads[span], allow_unused=True)
                if need_x:
                    grad_x[span] = got[0]  # type: ignore[index]
                    got = got[1:]
                it = iter(got)
                for j, n in enumerate(need_w):
                    g = next(it) if n else None
                    if g is None:
                        continue
                    if acc[j] is None:
                        acc[j] = g if g.dtype == torch.float32 else g.float()
                    else:
                        acc[j].add_(g)  # type: ignore[union-attr]
        weight_grads = [None if a is None else a.to(w.dtype) for a, w in zip(acc, weights)]
        return (None, None if grad_x is None else grad_x.view_as(x), *weight_grads)
