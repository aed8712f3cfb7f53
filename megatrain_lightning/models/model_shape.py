"""What a model costs per token: the numbers behind tokens/s → TFLOPS → MFU.

Model FLOPs per real token follow the usual convention (PaLM appendix B, DESIGN.md §6):
`6·N + 12·L·H·Q·T`, where N counts the parameters a token passes through (the input embedding
table is a lookup, not a matmul, so it is left out; the LM head stays in even when it is tied to the
embedding; for a mixture of experts only `experts_per_token / num_experts` of the expert weights),
L layers, H query heads, Q head dimension, T sequence length. Recompute is not model work: the
hardware figure `8·N + 16·L·H·Q·T` (one extra forward) is reported separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


def expert_share(config: Any) -> float:
    """The fraction of its experts' weights a token passes through: ``num_experts_per_tok`` of
    ``num_local_experts`` (or ``num_experts``); 1.0 for a dense model."""
    experts_total = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    experts_active = getattr(config, "num_experts_per_tok", None)
    return experts_active / experts_total if experts_total and experts_active else 1.0


def is_expert_weight(name: str) -> bool:
    """Whether a parameter (by its qualified name) is a routed expert's weight: under an ``experts`` module
    (Hugging Face's 3-d ``*Experts`` and ModuleList experts alike; a shared expert is not one)."""
    return ".experts." in f".{name}."


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts and attention dimensions of a causal LM."""

    total_params: int
    active_params: int  # N above
    layers: int
    heads: int
    head_dim: int

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs (forward + backward) per real token at sequence length `seq_len`."""
        return 6 * self.active_params + 12 * self.layers * self.heads * self.head_dim * seq_len

    def hardware_flops_per_token(self, seq_len: int) -> float:
        """As `flops_per_token`, plus the forward recomputed in backward."""
        return 8 * self.active_params + 16 * self.layers * self.heads * self.head_dim * seq_len

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """Counts from a Hugging Face causal LM (works on the meta device: no memory touched)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        share = expert_share(config)
        total = active = 0.0
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if p is embed:
                continue
            if share < 1.0 and is_expert_weight(name):
                active += p.numel() * share
            else:
                active += p.numel()
        if head is not None and head.weight is embed:  # tied: the table is also the output matmul
            active += embed.numel()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(int(total), int(active), config.num_hidden_layers, heads, head_dim)
