"""What the planner needs of a model: parameter counts and widths, read off a meta-device model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlanShape:
    """Counts (parameters) and widths (elements) of a causal LM, as MegaTrainStrategy would stream it."""

    total_params: int  # every parameter once (tied weights once)
    block_params: int  # sum over the streamed blocks
    largest_block: int  # parameters of the largest block: the size of a slot
    resident_params: int  # everything outside the blocks: embeddings, final norm, head
    head_params: int  # the LM head's matmul weight (the embedding when tied)
    layers: int
    heads: int
    head_dim: int
    kv_dim: int  # key/value heads x head dim
    hidden: int
    intermediate: int
    vocab: int
    # Frozen weights (no master, gradient or moments): how many parameters train, and the host bytes of the
    # rest in their own dtype. None: every parameter trains.
    trainable_params: int | None = None
    frozen_bytes: float = 0.0
    # Mixture of experts: the block parameters a token passes through (its experts_per_token / num_experts
    # of the expert weights, models/model_shape.py's rule). Device FLOPs follow these; the copies and the host
    # AdamW touch every block parameter. None: a dense model (all of them).
    active_block_params: int | None = None
    # Mixture of experts: the (token, expert) rows a token is routed to over all blocks (experts per token x
    # the blocks with routed experts): the routing's gathers, scatters and elementwise work scale with these
    # rows x hidden. 0: a dense model.
    routed_rows: int = 0
    # Mixture of experts: whether every block's experts compile inside their block's graph when blocks compile
    # (engine/compiled.inside_graphs: grouped GEMM experts without biases), the routing's gathers, casts and
    # weighting fused with the rest; else they run eager between two graphs (GPT-OSS's, a user's loop).
    routing_inside: bool = False
    # Mixture of experts: the experts a token is routed to in a block with routed experts, and one expert's MLP
    # width (``moe_intermediate_size``, else ``intermediate_size``): a kept block's activations scale with these
    # (plan/memory.py). 0: a dense model.
    experts_per_token: int = 0
    expert_intermediate: int = 0
    # Parameters of the blocks' position-wise MLPs (the ``mlp`` submodules: what ``mlp_chunk_tokens``
    # chunks). None: a gated MLP assumed, 3 x hidden x intermediate per layer.
    mlp_params: int | None = None
    # Whether chunking the MLP also runs the norm before it in the chunks (models/chunked_mlp.folded_norm).
    mlp_folds_norm: bool = False

    @property
    def active_blocks(self) -> int:
        return self.block_params if self.active_block_params is None else self.active_block_params

    @property
    def active_fraction(self) -> float:
        """Block parameters a token passes through, over those the host updates and the link carries."""
        return self.active_blocks / max(self.block_params, 1)

    @property
    def trained(self) -> int:
        return self.total_params if self.trainable_params is None else self.trainable_params

    @property
    def trained_fraction(self) -> float:
        return self.trained / max(self.total_params, 1)

    @property
    def mlp(self) -> int:
        """Parameters of all the blocks' MLPs."""
        return self.mlp_params if self.mlp_params is not None else 3 * self.hidden * self.intermediate * self.layers

    def model_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token (DESIGN.md section 6, as ``models.ModelShape``): ``6·N + 12·L·H·Q·T``, N without
        the input embedding table (a lookup) unless it is tied to the head; a mixture of experts counts the
        block parameters a token passes through (``active_blocks``), as ``ModelShape.active_params`` does."""
        lookup = self.vocab * self.hidden if self.untied_head() else 0
        active = self.total_params - (self.block_params - self.active_blocks)
        return 6 * (active - lookup) + 12 * self.layers * self.heads * self.head_dim * seq_len

    @classmethod
    def of(cls, model: Any) -> PlanShape:
        """Counts from a Hugging Face causal LM (the meta device is fine); the blocks are the ones
        MegaTrainStrategy would stream."""
        from ..blocks import find_blocks
        from ..engine.compiled import experts_of, inside_graphs
        from ..models.chunked_mlp import folded_norm
        from ..models.model_shape import expert_share, is_expert_weight

        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        blocks = [m for _, m in find_blocks(model)]
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        share = expert_share(config)
        active = sum(p.numel() * (share if is_expert_weight(n) else 1.0) for b in blocks for n, p in b.named_parameters())
        total = sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied weights
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        out = model.get_output_embeddings()
        return cls(
            total_params=total,
            block_params=sum(sizes),
            largest_block=max(sizes),
            resident_params=total - sum(sizes),
            head_params=out.weight.numel() if out is not None else 0,
            layers=len(blocks),
            heads=heads,
            head_dim=head_dim,
            kv_dim=kv_heads * head_dim,
            hidden=config.hidden_size,
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            vocab=config.vocab_size,
            active_block_params=round(active) if share < 1.0 else None,
            routed_rows=(getattr(config, "num_experts_per_tok", 0) or 0) * sum(
                any(is_expert_weight(n) for n, _ in b.named_parameters()) for b in blocks) if share < 1.0 else 0,
            routing_inside=share < 1.0 and all(experts_of(b) and all(inside_graphs(e) for e in experts_of(b))
                                               for b in blocks if any(is_expert_weight(n) for n, _ in b.named_parameters())),
            experts_per_token=(getattr(config, "num_experts_per_tok", 0) or 0) if share < 1.0 else 0,
            expert_intermediate=(getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None)
                                 or 0) if share < 1.0 else 0,
            mlp_params=sum(p.numel() for b in blocks if getattr(b, "mlp", None) is not None for p in b.mlp.parameters()),
            mlp_folds_norm=all(folded_norm(b) is not None for b in blocks),
        )

    def untied_head(self) -> int:
        """Parameters of an untied LM head (0 when tied): with the final norm, the resident part after the blocks."""
        return self.head_params if self.resident_params >= 2 * self.head_params > 0 else 0
