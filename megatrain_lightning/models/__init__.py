"""Hugging Face causal LMs as LightningModules, built from configs or local checkpoints."""

from megatrain_lightning.models.causal_lm import CausalLM
from megatrain_lightning.models.chunked_mlp import chunk_mlp
from megatrain_lightning.models import expert_routing, sink_attention
from megatrain_lightning.models.model_shape import ModelShape

sink_attention.register()  # attn_implementation="fused_sinks": GPT-OSS's sinks through SDPA's kernels
expert_routing.register()  # experts_implementation="grouped_mm_gather": MoE routing with a gather-only backward

__all__ = ["CausalLM", "ModelShape", "chunk_mlp"]
