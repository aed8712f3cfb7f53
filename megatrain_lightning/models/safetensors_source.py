"""A local Hugging Face safetensors checkpoint, read tensor by tensor into a model built on the meta device.

`from_pretrained` builds the whole model on the host before MegaTrainStrategy's store can take it over,
and the checkpoint pages it read stay mapped meanwhile (measured on a 2.5 GiB Llama: peak host RSS
1.5x the fp32 weights from a bf16 checkpoint, 1.3x from an fp32 one). Instead `load_pretrained`
(build.py) builds the model on the meta device and attaches a :class:`SafetensorsSource`; as the engine
materialises each block just before building its store, the initialiser (`megatrain_lightning/init.py`)
has the source copy that block's own tensors out of the files, converting bf16/fp16 to the fp32 masters
on the way. Peak host memory: the store plus about one block (the engine materialises the resident
part, embeddings and head, at once: that is the larger transient when it outweighs a block), plus one
16 MiB read chunk.

Before anything is allocated, the safetensors headers (`model.safetensors`, or the shards listed in
`model.safetensors.index.json`) are checked against the model built from the checkpoint's config.json:

- every parameter and persistent buffer needs a tensor of its shape. A tie needs only one of its names
  (`lm_head.weight` tied to `model.embed_tokens.weight` is read once, from whichever the file holds).
  A missing one is a ConfigError naming it: `from_pretrained` would initialise it at random with a
  warning, and a fine-tuning run from a checkpoint with holes is far more likely a mistake.
  `MegaTrainStrategy(meta_init=False)` gives `from_pretrained`'s behaviour (and its memory cost).
- checkpoint tensors the model does not have are ignored with a warning, as `from_pretrained` does
  (older Llama checkpoints carry `rotary_emb.inv_freq`, for instance).
- non-persistent buffers (rotary `inv_freq`) are in no checkpoint; they are computed as for a random
  init.

Names are read as the model's own `state_dict()` names, which is what transformers 5 loads for Llama,
Qwen2/3, Mistral and every model without a registered checkpoint conversion. Models whose tensors
transformers renames, fuses or dequantises while loading (Mixtral-style experts, quantized checkpoints)
are reported by :func:`lazy_load_refusal`, and `load_pretrained` then falls back to `from_pretrained`.

Every read opens its shard, reads one chunk of at most 16 MiB (of fp32) and closes it again.
safetensors maps the file, and the pages read through a map stay in this process's RSS until the
handle is closed (measured: one handle kept open while reading a 1 GiB shard leaves +1.0 GiB of
RssFile; opened per read, +4 MB); an open costs about 0.5 ms (one header parse), about 2000 opens
(1 s) for a 7B model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from safetensors import safe_open
from torch import nn

from megatrain_lightning.errors import ConfigError

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 * 2**20  # largest read at once (in fp32 bytes of the destination): the transient cost


@dataclass(frozen=True)
class _Entry:
    """Where one checkpoint tensor lives, and its shape (from the file's header)."""

    file: str
    shape: tuple[int, ...]


def safetensors_files(path: str) -> list[str] | None:
    """The checkpoint's safetensors files, as `from_pretrained` picks them; None when it has none."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _weight_map(index)
        return sorted({os.path.join(path, f) for f in weight_map.values()})
    single = os.path.join(path, SINGLE_FILE)
    return [single] if os.path.isfile(single) else None


def lazy_load_refusal(path: str, model: nn.Module) -> str | None:
    """Why the checkpoint at ``path`` cannot be read tensor by tensor into ``model``; None when it can."""
    if safetensors_files(path) is None:
        return f"it has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors are read lazily)"
    config = getattr(model, "config", None)
    if getattr(config, "quantization_config", None):
        return "its weights are quantized, and transformers dequantizes them while loading"
    from transformers import PreTrainedModel

    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4.x: no registered load-time conversions
        get_checkpoint_conversion_mapping = None  # type: ignore[assignment]
    for m in model.modules():
        if not isinstance(m, PreTrainedModel):
            continue
        if getattr(m, "_checkpoint_conversion_mapping", None):
            return f"{type(m).__name__} renames checkpoint keys while loading (_checkpoint_conversion_mapping)"
        if get_checkpoint_conversion_mapping is not None:
            for name in (type(m).__name__, m.config.model_type):
                if name and get_checkpoint_conversion_mapping(name) is not None:
                    return f"transformers converts {name} checkpoint tensors while loading (renamed or fused)"
    return None


class SafetensorsSource:
    """The tensors of a local safetensors checkpoint, copied on demand into the modules of ``model``.

    Args:
        path: a Hugging Face checkpoint directory (`model.safetensors` or a sharded index).
        model: the model built from its config, on the meta device (shapes and names only; the
            source keeps no reference to it, only its module ids, names and ties).

    Raises ConfigError for an unreadable file, a missing tensor or a shape that differs from the model's.
    """

    def __init__(self, path: str, model: nn.Module) -> None:
        self.path = path
        files = safetensors_files(path)
        if files is None:
            raise ConfigError(f"model.pretrained={path} has no {SINGLE_FILE} or {INDEX_FILE}")
        self._entries = _read_headers(path, files)
        self._prefix: dict[int, str] = {}  # id(module) -> its qualified name in `model`, with the dot
        for name, m in model.named_modules(remove_duplicate=False):
            self._prefix.setdefault(id(m), f"{name}." if name else "")
        # Names sharing one tensor (ties) form one group, named by its first name; it is read once.
        self._group: dict[str, str] = {}
        members: dict[str, list[str]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        first: dict[int, str] = {}
        for name, t in _named_state(model):
            group = first.setdefault(id(t), name)
            self._group[name] = group
            members.setdefault(group, []).append(name)
            shapes[group] = tuple(t.shape)
        self._key: dict[str, str] = {}  # group -> the checkpoint key it is read from
        missing: list[str] = []
        for group, names in members.items():
            key = next((n for n in names if n in self._entries), None)
            if key is None:
                missing.append(" / ".join(names))
                continue
            entry = self._entries[key]
            if entry.shape != shapes[group]:
                raise ConfigError(
                    f"model.pretrained={path}: {key} has shape {list(entry.shape)} in "
                    f"{os.path.basename(entry.file)}, but the model built from its config.json expects "
                    f"{list(shapes[group])}"
                )
            self._key[group] = key
        if missing:
            more = f" (and {len(missing) - 1} more: {', '.join(missing[1:4])}{', ...' if len(missing) > 4 else ''})"
            raise ConfigError(
                f"model.pretrained={path}: the checkpoint has no tensor {missing[0]}"
                f"{more if len(missing) > 1 else ''}, which {type(model).__name__} needs. Loading into "
                "MegaTrainStrategy's store refuses to start with uninitialised weights; "
                "MegaTrainStrategy(meta_init=False) loads through from_pretrained instead, which initialises "
                "missing weights at random (and builds the whole model on the host first)"
            )
        ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        unused = sorted(k for k in self._entries if k not in self._group and not any(p.search(k) for p in ignore))
        if unused:
            log.warning(
                "model.pretrained=%s: %d checkpoint tensors are not used by %s: %s%s",
                path, len(unused), type(model).__name__, ", ".join(unused[:5]), ", ..." if len(unused) > 5 else "",
            )
        self._pending = set(self._key)

    @property
    def complete(self) -> bool:
        """True once every tensor of the model has been read."""
        return not self._pending

    @torch.no_grad()
    def fill(self, modules: Sequence[nn.Module]) -> None:
        """Copy each module's own parameters and persistent buffers from the files, converting dtype.

        A tensor already read through another name of a tie is skipped.
        """
        for m in modules:
            prefix = self._prefix.get(id(m))
            if prefix is None:
                raise ValueError(f"a {type(m).__name__} is not part of the model read from {self.path}")
            for name, t in _own_state(m):
                group = self._group.get(prefix + name)
                if group is None:
                    raise ValueError(f"{prefix + name} was added to the model after {self.path} was indexed")
                if group in self._pending:
                    self._read_into(self._key[group], t)
                    self._pending.discard(group)

    def _read_into(self, key: str, dst: torch.Tensor) -> None:
        """Copy one checkpoint tensor into ``dst``, at most CHUNK_BYTES at a time; NaN refused by name."""
        entry = self._entries[key]
        if not entry.shape:
            with safe_open(entry.file, framework="pt") as f:
                dst.copy_(f.get_tensor(key))
            refuse_nan(self.path, key, dst)
            return
        rows = entry.shape[0]
        row_bytes = math.prod(entry.shape[1:]) * dst.element_size()
        step = max(1, CHUNK_BYTES // max(1, row_bytes))
        for start in range(0, rows, step):
            # A fresh handle per chunk: closing it unmaps the pages just read (see the module docstring).
            with safe_open(entry.file, framework="pt") as f:
                dst[start : start + step].copy_(f.get_slice(key)[start : start + step])  # bf16 -> fp32 here
        refuse_nan(self.path, key, dst)


def refuse_nan(path: str, name: str, t: torch.Tensor) -> None:
    """A ConfigError naming a checkpoint tensor that holds NaN: every loss would be NaN from the first step, and
    training would go on (Lightning does not stop on it). Infinities are left: some models keep -inf in buffers."""
    if t.is_floating_point() and bool(torch.isnan(t).any()):
        raise ConfigError(
            f"model.pretrained={path}: {name} holds {int(torch.isnan(t).sum())} NaN of {t.numel()} values, so every "
            "loss would be NaN: the checkpoint is damaged or was saved after a run diverged. Use an earlier or "
            "freshly downloaded copy of it")


def _own_state(m: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters and persistent buffers, as `state_dict(recurse=False)` names them."""
    for name, p in m._parameters.items():
        if p is not None:
            yield name, p
    for name, b in m._buffers.items():
        if b is not None and name not in m._non_persistent_buffers_set:
            yield name, b


def _named_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every `state_dict()` name of ``model``, tied names included (each with its tensor)."""
    for prefix, m in model.named_modules(remove_duplicate=False):
        for name, t in _own_state(m):
            yield (f"{prefix}.{name}" if prefix else name), t


def _weight_map(index: str) -> dict[str, str]:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{index}: not a safetensors index with a weight_map ({err})") from err
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{index}: weight_map is not a mapping of tensor names to shard files")
    return weight_map


def _read_headers(path: str, files: list[str]) -> dict[str, _Entry]:
    """Name, file and shape of every checkpoint tensor, from the headers only (no tensor data)."""
    headers: dict[str, dict[str, _Entry]] = {}
    for file in files:
        if not os.path.isfile(file):
            raise ConfigError(
                f"model.pretrained={path}: {INDEX_FILE} lists {os.path.basename(file)}, which does not exist"
            )
        try:
            with safe_open(file, framework="pt") as f:
                headers[file] = {k: _Entry(file, tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        except Exception as err:  # safetensors raises its own SafetensorError, with the reason
            raise ConfigError(
                f"model.pretrained={path}: {os.path.basename(file)} is not a readable safetensors file ({err})"
            ) from err
    index = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index):
        return headers[files[0]]
    entries: dict[str, _Entry] = {}
    for key, shard in _weight_map(index).items():
        entry = headers[os.path.join(path, shard)].get(key)
        if entry is None:
            raise ConfigError(f"model.pretrained={path}: {INDEX_FILE} puts {key} in {shard}, which does not hold it")
        entries[key] = entry
    return entries
