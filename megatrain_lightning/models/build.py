"""Building Hugging Face causal LMs without ever holding the full model twice.

A random-init model is first built on the meta device (shapes only, no memory), which is also how
parameters are counted before anything is allocated; `materialize` then gives it storage once, on
its final device, and runs Hugging Face's own initialisation (including the rotary `inv_freq`
buffers that `to_empty` leaves as garbage, and re-tying the embedding to the LM head).

A pretrained model under MegaTrainStrategy is built on the meta device as well, with its checkpoint
attached as a weights source (`safetensors_source.py`): the strategy reads each block from the files
as it materialises it into the host store.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import logging
import os
import re
from typing import Any

import torch
from transformers import (
    CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel,
)

from megatrain_lightning.errors import ConfigError
from megatrain_lightning.init import attach_weights_source
from megatrain_lightning.models import expert_routing
from megatrain_lightning.models.safetensors_source import SafetensorsSource, lazy_load_refusal, refuse_nan

log = logging.getLogger(__name__)


def hf_config(config: dict[str, Any]) -> PretrainedConfig:
    """A transformers config from a plain dict with a `model_type` key (e.g. `llama`, `qwen2`)."""
    params = dict(config)
    model_type = params.pop("model_type", None)
    if model_type is None:
        raise ConfigError("model.config needs a model_type (e.g. llama, qwen2, qwen3, mistral, gpt_oss)")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        raise ConfigError(f"model.config.model_type={model_type!r} is not a transformers model type"
                          + (f" (did you mean {close[0]}?)" if close else ""))
    try:
        built = AutoConfig.for_model(model_type, **params)
    except Exception as err:  # the config class's own validation (ValueError, huggingface_hub's validators)
        reason = [line.strip() for line in str(err).splitlines() if line.strip()][-1:] or [type(err).__name__]
        raise ConfigError(f"model.config ({model_type}) is refused by transformers: {reason[0]}") from err
    unread = _unread_keys(model_type, params, built)
    if unread:
        known = _known_keys(model_type)
        hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, known, n=1)) else k
                 for k in unread]
        raise ConfigError(
            f"model.config has keys that neither transformers' {type(built).__name__} nor the {model_type} model "
            f"reads: {', '.join(hints)}. They would be kept and ignored, training a model other than the one meant: "
            "fix their spelling, or remove them")
    _check_sizes(model_type, built)
    vocab = getattr(built, "vocab_size", None)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        ids = getattr(built, key, None)
        listed = ids if isinstance(ids, (list, tuple)) else [ids]
        outside = [i for i in listed if isinstance(i, int) and vocab and i >= vocab]
        if outside:
            raise ConfigError(
                f"model.config.{key}={ids} is outside the vocabulary (model.config.vocab_size={vocab}): the embedding "
                f"has no row {outside[0]}. Set model.config.{key} below {vocab} (or null), or raise vocab_size")
    return built


def _known_keys(model_type: str) -> list[str]:
    """The keys a model type's config class takes or sets by default."""
    cls = CONFIG_MAPPING[model_type]
    known = set(inspect.signature(cls.__init__).parameters) | set(cls.attribute_map)
    known |= set(inspect.signature(PretrainedConfig.__init__).parameters)
    try:
        known |= set(cls().to_dict())
    except Exception:  # a config class without defaults for everything: its signature says enough
        pass
    return sorted(k for k in known if k not in ("self", "kwargs"))


def _unread_keys(model_type: str, params: dict[str, Any], built: PretrainedConfig) -> list[str]:
    """Keys given that the config class does not know and kept as bare attributes (AutoConfig keeps any
    key), which the model type's modeling code never reads either (as `config.<key>` or `"<key>"`): they can have
    no effect (a misspelling)."""
    known = set(_known_keys(model_type))
    extra = [k for k in params if k not in known and k in vars(built)]
    if not extra:
        return []
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    try:  # the model's own code, and what every model and config inherits (pruned_heads, tie_encoder_decoder, ...)
        source = "\n".join(_source(name) for name in (
            f"transformers.models.{module}.modeling_{module}", "transformers.modeling_utils",
            "transformers.configuration_utils"))
    except (ImportError, OSError, TypeError):  # no modeling file to read: no grounds to refuse
        return []
    return [k for k in extra if not re.search(rf"config\.{re.escape(k)}\b|[\"']{re.escape(k)}[\"']", source)]


@functools.lru_cache(maxsize=None)
def _source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


# sizes a model cannot be built or run with below 1 (where its config has them; num_hidden_layers: CausalLM says
# what streaming needs)
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "max_position_embeddings")


def _check_sizes(model_type: str, built: PretrainedConfig) -> None:
    """Values transformers takes but the model then fails on, deep in its build or first forward."""
    from transformers.activations import ACT2FN

    text = built.get_text_config()
    for key in _POSITIVE:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"model.config.{key}={value}: a {model_type} model needs it to be at least 1")
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ConfigError(
            f"model.config.num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}: each key/value "
            f"head serves a whole group of query heads. Set num_key_value_heads to a divisor of {heads}")
    act = getattr(text, "hidden_act", None)
    if isinstance(act, str) and act not in ACT2FN:
        close = difflib.get_close_matches(act, list(ACT2FN), n=1)
        raise ConfigError(f"model.config.hidden_act={act!r} is not an activation transformers knows"
                          + (f" (did you mean {close[0]}?)" if close else f"; one of {', '.join(ACT2FN)}"))


def pretrained_config(path: str, weights: bool = True) -> PretrainedConfig:
    """The config of a local Hugging Face checkpoint directory; never touches the network. ``weights``: the
    directory must hold weight files too (the planner reads the config alone)."""
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"model.pretrained={path} {what} (it must be a local Hugging Face checkpoint directory, the "
                          "one holding config.json)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model.pretrained={path} has no config.json: not a Hugging Face checkpoint directory")
    if weights and not any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path)):
        raise ConfigError(f"model.pretrained={path} has a config.json but no weights (*.safetensors, *.bin, *.pt, "
                          "*.pth): copy the checkpoint's weight files there, or set model.config for a model trained "
                          "from random initialisation")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:  # not JSON, no or an unknown model_type
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model.pretrained={path}: its config.json cannot be read by transformers ({first}). Copy "
                          "config.json again from where the checkpoint came from (a model type this transformers does not know: "
                          "upgrade transformers)") from None


# the files transformers' from_pretrained reads weights from (safetensors, torch pickles, and their indexes)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def meta_model(config: PretrainedConfig, attn_implementation: str | None = None) -> PreTrainedModel:
    """The model with every tensor on the meta device: costs no memory, gives exact shapes."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def route_experts(model: PreTrainedModel, experts_implementation: str | None) -> PreTrainedModel:
    """Set how the model's mixture-of-experts layers run: `experts_implementation` if given (transformers'
    `eager`, `grouped_mm`, `batched_mm`, ... or `grouped_mm_gather`); None: `grouped_mm_gather` where
    transformers chose `grouped_mm` for the model's experts (models/expert_routing.py: the same function, with a
    backward of gathers). Dense models are left as they are."""
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    elif model.config._experts_implementation == "grouped_mm" and any(
        hasattr(m, "is_concatenated") for m in model.modules()  # set by transformers' use_experts_implementation
    ):
        model.set_experts_implementation(expert_routing.NAME)
    return model


def materialize(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """Allocate a meta model's tensors on `device` and initialise them as `from_config` would."""
    model.to_empty(device=device)
    with torch.device(device):
        model.init_weights()  # HF init + re-tie (to_empty gave tied weights separate storage)
    return model


def load_pretrained(path: str, attn_implementation: str | None = None) -> PreTrainedModel:
    """Weights from a local checkpoint, in fp32 (the master copy; mixed precision casts per op).

    Under a meta default device (MegaTrainStrategy's `configure_model`, `meta_init=True`) the model is
    built on the meta device from the checkpoint's config and its safetensors files are attached as a
    weights source: the strategy reads each block (bf16/fp16 converted to fp32) just before it becomes
    part of the host store, so peak host memory is the store plus about one block, and the checkpoint is
    checked against the model before anything is allocated. Whoever materialises a model built so must
    fill it through `megatrain_lightning.init.initializer_for`, as MegaTrainStrategy does.
    A checkpoint that cannot be read so (no safetensors, quantized, or tensors that transformers
    converts while loading) loads through `from_pretrained` on the host, with a warning: the whole
    model plus the checkpoint pages it read before the store takes it over (measured 1.3-1.5x the fp32
    weights). Otherwise `from_pretrained` on the default device.
    """
    config = pretrained_config(path)  # the clear error for a wrong path, before transformers' own
    device = torch.get_default_device()
    if device.type == "meta":
        model = meta_model(config, attn_implementation)
        refusal = lazy_load_refusal(path, model)
        if refusal is None:
            attach_weights_source(model, SafetensorsSource(path, model))
            if model.can_generate() and os.path.isfile(os.path.join(path, "generation_config.json")):
                model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
            return model
        log.warning(
            "model.pretrained=%s is loaded whole through from_pretrained, then moved into the host store "
            "(peak host memory up to about 1.5x the weights, not the store plus one block): %s", path, refusal,
        )
    with torch.device("cpu" if device.type == "meta" else device):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation, local_files_only=True
        )
    for name, t in model.state_dict().items():
        refuse_nan(path, name, t)
    return model
