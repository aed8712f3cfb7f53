"""Building Hugging Face causal LMs without ever holding the full model twice.

A random-init model is first built on the meta device (shapes only, no memory), which is also how
parameters are counted before anything is allocated; `materialize` then gives it storage once, on
its final device, and runs Hugging Face's own initialisation (including the rotary `inv_freq`
buffers that `to_empty` leaves as garbage, and re-tying the embedding to the LM head).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from megatrain_lightning.errors import ConfigError


def hf_config(config: dict[str, Any]) -> PretrainedConfig:
    """A transformers config from a plain dict with a `model_type` key (e.g. `llama`, `qwen2`)."""
    params = dict(config)
    model_type = params.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model.config needs a model_type (e.g. llama, qwen2, qwen3, mistral, gpt_oss)")
    try:
        return AutoConfig.for_model(model_type, **params)
    except ValueError as err:
        raise ConfigError(f"model.config.model_type={model_type!r} is not a transformers model type") from err


def pretrained_config(path: str) -> PretrainedConfig:
    """The config of a local Hugging Face checkpoint directory; never touches the network."""
    if not os.path.isdir(path):
        raise ConfigError(f"model.pretrained={path} does not exist (it must be a local Hugging Face checkpoint directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.pretrained={path} has no config.json: not a Hugging Face checkpoint directory")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def meta_model(config: PretrainedConfig, attn_implementation: str | None = None) -> PreTrainedModel:
    """The model with every tensor on the meta device: costs no memory, gives exact shapes."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def materialize(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """Allocate a meta model's tensors on `device` and initialise them as `from_config` would."""
    model.to_empty(device=device)
    with torch.device(device):
        model.init_weights()  # HF init + re-tie (to_empty gave tied weights separate storage)
    return model


def load_pretrained(path: str, attn_implementation: str | None = None) -> PreTrainedModel:
    """Weights from a local checkpoint, in fp32 (the master copy; mixed precision casts per op)."""
    pretrained_config(path)  # the clear error for a wrong path, before transformers' own
    # Under a meta init context (MegaTrainStrategy's configure_model) real weights load on the host;
    # the strategy then moves them into its store block by block.
    device = torch.get_default_device()
    with torch.device("cpu" if device.type == "meta" else device):
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation, local_files_only=True
        )
