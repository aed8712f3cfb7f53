"""Hugging Face causal LMs as LightningModules, built from configs or local checkpoints."""

from megatrain_lightning.models.causal_lm import CausalLM
from megatrain_lightning.models.chunked_mlp import chunk_mlp
from megatrain_lightning.models import sink_attention
from megatrain_lightning.models.model_shape import ModelShape

sink_attention.register()  # attn_implementation="fused_sinks": GPT-OSS's sinks through SDPA's kernels

__all__ = ["CausalLM", "ModelShape", "chunk_mlp"]
