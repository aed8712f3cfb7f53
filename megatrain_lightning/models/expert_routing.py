"""Mixture-of-experts routing whose backward is gathers: `experts_implementation="grouped_mm_gather"`.

Transformers' `grouped_mm` experts (the default for every HF MoE) sort the (token, expert) pairs by expert,
run each expert's rows through `grouped_mm`, and put the rows back. It moves rows with advanced indexing
(`hidden[perm // k]`, `bias[expert_ids]`, `out[inv_perm]`), whose backward is `index_put_(accumulate=True)`:
on CUDA a sort plus `indexing_backward_kernel`, which walks the rows of each repeated index one after the
other. For the expert biases every row of an expert is such a repeat (GPT-OSS-20B at 34 x 2048 tokens: 278 K
rows onto 32 experts), and that kernel took 585 ms of a 2.5 s step (23 %, the largest kernel of the step).

This module registers the same function with the same forward, value for value, and backward passes that
are gathers and GEMMs:

- token rows into expert order: `index_select(hidden, perm // k)`, cast to the experts' weight dtype first (the
  cast the grouped GEMM makes of its input; under autocast the k-fold rows are bf16, not the fp32 residual
  stream's dtype); backward, the pair-order gradient `index_select(grad, inv_perm)` summed over each token's k
  pairs (a reshape-sum, fp32 accumulation);
- a permutation (the routing weights, the rows back to pair order): `index_select` both ways;
- the per-row expert bias: `index_select(bias, expert_ids)`; backward, `one_hot(expert_ids)^T @ grad`, one
  GEMM of [E, S] x [S, out] (fp32 accumulation).

Everything else is Transformers' own: `_grouped_linear` (so `grouped_mm` on the GPU), the experts'
`_apply_gate`, the reshape-sum over the k pairs; but the bias is added out of place (transformers adds it into
the grouped_mm output in place, which a selective recompute that saves matmul outputs refuses: "Tensor cached
during selective activation checkpoint has been mutated"). Expert parallelism (sentinel rows) is refused.
`tests/test_expert_routing.py` checks outputs and every gradient against `eager` and `grouped_mm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "grouped_mm_gather"


class _RowsToExperts(torch.autograd.Function):
    """out[i] = x[perm[i] // k].to(dtype): each token's row k times, in expert order, in the experts' weight dtype.

    The cast is the one the grouped GEMM makes of its input (transformers' ``_grouped_mm``: ``input.to(weight.dtype)``),
    made on the tokens before they are repeated: the same values, but under autocast (an fp32 residual stream, bf16
    weights) the k-fold rows are written and read in bf16, not fp32. The backward sums each token's k rows of the
    gradient in fp32 (``sum(dtype=float32)``), as the sum of their fp32 casts did, then casts to ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor, k: int,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.x_dtype = k, x.dtype
        return x.to(dtype).index_select(0, perm // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        pairs = grad.index_select(0, inverse)  # pair order: token t's k rows are rows t*k .. t*k+k-1
        acc = torch.promote_types(grad.dtype, torch.float32) if ctx.x_dtype != grad.dtype else grad.dtype
        summed = pairs.view(-1, ctx.k, grad.shape[-1]).sum(dim=1, dtype=acc)
        return summed.to(ctx.x_dtype), None, None, None, None


class _Permute(torch.autograd.Function):
    """out = x[index] for a permutation `index` whose inverse is `inverse`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _ExpertRows(torch.autograd.Function):
    """out[i] = bias[expert_ids[i]]: each row's expert bias."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(expert_ids)
        ctx.experts = bias.shape[0]
        return bias.index_select(0, expert_ids)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (expert_ids,) = ctx.saved_tensors
        one_hot = F.one_hot(expert_ids, ctx.experts).to(grad.dtype)  # [S, E], lives for this GEMM only
        return one_hot.t().matmul(grad), None


def grouped_mm_gather_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Transformers' `grouped_mm_experts_forward` with the rows moved by `_RowsToExperts`, `_Permute` and
    `_ExpertRows` (same arguments, same result)."""
    from transformers.integrations.moe import _grouped_linear

    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(
            f"experts_implementation='{NAME}' does not handle expert parallelism (sentinel rows): use 'grouped_mm'"
        )
    k = top_k_index.size(-1)
    tokens, hidden = hidden_states.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # pairs sorted by expert, as transformers sorts them
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)

    first = self.gate_up_proj if self.has_gate else self.up_proj  # the first grouped GEMM casts its input to this
    rows = _RowsToExperts.apply(hidden_states, perm, inverse, k, first.dtype)
    weights = _Permute.apply(top_k_weights.reshape(-1), perm, inverse)
    # tokens per expert, as transformers counts them (histc: no host sync; CPU histc takes floats only)
    counts_of = expert_ids.float() if expert_ids.device.type in ("cpu", "mps") else expert_ids.int()
    counts = torch.histc(counts_of, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)

    def linear(x: torch.Tensor, weight: str) -> torch.Tensor:
        out = _grouped_linear(x, getattr(self, weight), offsets, is_transposed=self.is_transposed)
        # the bias added out of place (transformers adds it in place): the grouped_mm output stays as it was
        # made, which a selective recompute saving matmul outputs (kept_saves="matmuls") requires
        return out + _ExpertRows.apply(getattr(self, f"{weight}_bias"), expert_ids) if self.has_bias else out

    if self.has_gate:
        out = self._apply_gate(linear(rows, "gate_up_proj"))
    else:
        out = self.act_fn(linear(rows, "up_proj"))
    out = linear(out, "down_proj")
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = out * weights.unsqueeze(-1)
    out = _Permute.apply(out, inverse, perm)  # back to pair order
    return out.view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Make `experts_implementation="grouped_mm_gather"` known to transformers."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, grouped_mm_gather_experts_forward)
