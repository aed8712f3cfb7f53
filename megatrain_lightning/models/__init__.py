"""Hugging Face causal LMs as LightningModules, built from configs or local checkpoints."""

from megatrain_lightning.models.causal_lm import CausalLM
from megatrain_lightning.models.chunked_mlp import chunk_mlp
from megatrain_lightning.models.model_shape import ModelShape

__all__ = ["CausalLM", "ModelShape", "chunk_mlp"]
