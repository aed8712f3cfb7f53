"""Export a trained model as a Hugging Face directory: config plus sharded safetensors, block by block.

    from megatrain_lightning.export import export_hf
    export_hf(module.model, "out/hf", dtype=torch.bfloat16)   # then AutoModelForCausalLM.from_pretrained("out/hf")

The files are what `PreTrainedModel.save_pretrained` writes (`config.json`, `generation_config.json`,
`model.safetensors` or `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`, the
tokenizer's files when one is given), but the weights are read in `state_dict()` order, one block (one
transformer layer) at a time, and a shard is written as soon as it is full. `save_pretrained` instead
gathers the whole state dict first and, asked for another dtype, would need a converted copy of the
whole model; here at most one shard of converted tensors (plus the rest of the block being read) is in
host memory, and fp32 weights written as fp32 are not copied at all (recent safetensors write straight
from the weights' own memory).

The export is atomic: everything goes into a temporary sibling directory, is fsynced, and is renamed
into place only when complete; an existing `out_dir` is replaced only then. A crash at any point leaves
the previous export as it was (a hard kill can leave a `.NAME.tmp-*` sibling, which is safe to delete).
"""

from __future__ import annotations


import copy
import json
import logging
import os
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from transformers import PreTrainedModel

from megatrain_lightning.atomic_dir import fsync_tree, replace
from megatrain_lightning.errors import ConfigError

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class ExportError(ConfigError, ValueError):
    """Bad input to `export_hf`: a ValueError for Python callers, a ConfigError for `train.py`, which
    prints it as one line."""


def export_hf(
    model: PreTrainedModel,
    out_dir: str | os.PathLike[str],
    max_shard_bytes: int = 2 * 2**30,
    dtype: torch.dtype | None = None,
    tokenizer: Any | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model` to `out_dir` as a Hugging Face directory that `from_pretrained` loads.

    Args:
        model: the `transformers.PreTrainedModel` (for a LightningModule, the model inside it). Its
            weights may be host tensors, views into a flat store, or device tensors (copied to the host
            one at a time); meta tensors are refused.
        out_dir: the directory to (re)place. An existing one is replaced only when it is empty or
            holds a previous export (a `config.json`), so a typo cannot wipe an unrelated directory.
        max_shard_bytes: largest shard file. It bounds the host memory the export adds: one shard of
            converted tensors is held at a time (measured: +11 MB peak RSS exporting 240 MB of fp32
            weights to bf16 with 8 MiB shards; the C allocator may keep up to about one more shard
            cached). Larger shards mean fewer files. A tensor bigger than this gets a shard of its own.
        dtype: floating-point dtype to store (e.g. `torch.bfloat16`, half the bytes of fp32); integer
            tensors keep theirs. None keeps each tensor's dtype. `config.json` records it, so
            `from_pretrained(dtype="auto")` (the default) loads it as written.
        tokenizer: saved with its `save_pretrained` next to the weights, when given.
        state_dict: the tensors to write instead of `model.state_dict()` (the strategy's view of the
            trained weights, see `HFExport`); keys as in `model.state_dict()`.

    Returns:
        The absolute path of the finished export.

    Tied weights are written once, as `save_pretrained` does: names sharing one tensor's memory are
    reduced to the one that is not declared in a `_tied_weights_keys`, so `from_pretrained` re-ties
    them without reporting missing keys. Weights that transformers renames or fuses at load time
    (mixture-of-experts layers) are written in the checkpoint's original layout, one block at a time.
    """
    if not isinstance(model, PreTrainedModel):
        raise ExportError(
            f"model: expected a transformers.PreTrainedModel, got {type(model).__name__}; "
            "for a LightningModule pass the Hugging Face model inside it (e.g. `module.model`)"
        )
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ExportError(f"max_shard_bytes={max_shard_bytes!r}: expected a positive number of bytes (e.g. 2 * 2**30)")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ExportError(f"dtype={dtype!r}: expected a floating-point torch.dtype (torch.bfloat16, torch.float32) or None")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise ExportError(f"tokenizer: a {type(tokenizer).__name__} has no save_pretrained(); pass a transformers tokenizer or None")
    out = _check_out_dir(out_dir)

    state = dict(model.state_dict() if state_dict is None else state_dict)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    meta = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.device.type == "meta"]
    if meta:
        raise ExportError(f"model: {len(meta)} tensors ({meta[0]}, ...) are on the meta device, never materialised")
    state = _drop_tied_aliases(state, model)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_config(model, tmp, dtype or model.dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        total_size = _write_weights(model, state, tmp, max_shard_bytes, dtype)
        _usual_modes(tmp)
        fsync_tree(tmp)
        replace(tmp, out)
    except BaseException:  # KeyboardInterrupt too: the previous export must survive any interruption
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s (%.2f GB of weights) to %s", type(model).__name__, total_size / 1e9, out)
    return out


def _umask() -> int:
    """This process's umask, read without changing it (os.umask can only be read by setting it)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


def _usual_modes(directory: Path) -> None:
    """The modes a plain `mkdir` and `open` would have given (mkdtemp makes the directory 0700 and some
    writers make files 0600), so that an export is as readable as the rest of the run directory."""
    mask = _umask()
    directory.chmod(0o777 & ~mask)
    for p in directory.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


# ---------------------------------------------------------------------------------------------
# what is written
# ---------------------------------------------------------------------------------------------
def _write_config(model: PreTrainedModel, directory: Path, dtype: torch.dtype) -> None:
    """config.json as save_pretrained writes it (stored dtype, architecture), generation_config.json
    when the model generates. A copy: the model's own config is left untouched."""
    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def _write_weights(
    model: PreTrainedModel, state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int, dtype: torch.dtype | None
) -> int:
    """Fill shards in state-dict order, write each when the next tensor would overflow it; then name
    them `-of-N` (N is known only at the end) and write the index. Returns the bytes of weights."""
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_size = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        path = directory / f"shard-{len(parts) + 1:05d}.partial"
        # Called through the module attribute (tests interrupt an export here).
        safetensors.torch.save_file(shard, str(path), metadata={"format": "pt"})
        parts.append((path, list(shard)))
        shard, shard_bytes = {}, 0  # the shard's converted tensors are freed here

    for block in _blocks(state):
        for key, tensor in _original_format(model, block).items():
            target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * target.itemsize
            if shard and shard_bytes + nbytes > max_shard_bytes:
                flush()  # before converting the next tensor: never a full shard plus one more
            shard[key] = _host_tensor(tensor, target)
            shard_bytes += nbytes
            total_size += nbytes
    if shard or not parts:
        flush()

    if len(parts) == 1:
        parts[0][0].rename(directory / WEIGHTS_NAME)
        return total_size
    weight_map: dict[str, str] = {}
    for i, (path, keys) in enumerate(parts, start=1):
        name = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        path.rename(directory / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_parameters": model.num_parameters(), "total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return total_size


def _host_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor as safetensors stores it: host, contiguous, in `dtype`. A no-op (no copy) for a
    contiguous host tensor already in that dtype."""
    return tensor.detach().to(device="cpu", dtype=dtype).contiguous()


def _blocks(state: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Consecutive keys of one block (`model.layers.3.*`: up to the first numeric component) or, outside
    the blocks, of one module (`model.norm.*`). Conversions to the original layout act within these."""
    group: dict[str, torch.Tensor] = {}
    group_id = None
    for key, tensor in state.items():
        parts = key.split(".")
        numeric = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        gid = ".".join(parts[: numeric + 1]) if numeric is not None else ".".join(parts[:-1])
        if group and gid != group_id:
            yield group
            group = {}
        group_id = gid
        group[key] = tensor
    if group:
        yield group


def _original_format(model: PreTrainedModel, block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo the renames and fusions transformers applies at load time (e.g. per-expert weights fused
    into one tensor), as save_pretrained does; identity for most models and for older transformers."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: no load-time conversions to undo
        return block
    return revert_weight_conversion(model, block)


def _drop_tied_aliases(state: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Keep one name per tensor, the one `from_pretrained` expects, as save_pretrained does.

    Names are aliases when their tensors cover the same memory exactly. Of each set, the names matching
    a declared tied key (`_tied_weights_keys` of any submodule, e.g. `lm_head.weight`) are dropped and
    the model re-ties them at load. Distinct tensors that are merely views into one storage (the
    strategy's flat per-block store) are not aliases; partly overlapping ones cannot be written.
    """
    tied_patterns: list[str] = []
    for name, module in model.named_modules():
        declared = getattr(module, "_tied_weights_keys", None) or ()
        tied_patterns += [f"{name}.{k}" if name else k for k in declared]  # dict (v5) or list (v4)

    by_storage: dict[tuple[Any, int], list[str]] = defaultdict(list)
    for key, t in state.items():
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            by_storage[(t.device, t.untyped_storage().data_ptr())].append(key)

    drop: set[str] = set()
    for keys in by_storage.values():
        if len(keys) < 2:
            continue
        areas: dict[tuple[int, int], list[str]] = defaultdict(list)
        for key in keys:
            areas[_span(state[key])].append(key)
        last_end = -1
        for (start, end), names in sorted(areas.items()):
            if start < last_end:
                raise ExportError(f"model: {names} partly overlap other tensors in memory; safetensors cannot store that")
            last_end = max(last_end, end)
            if len(names) < 2:
                continue
            names = sorted(names)
            tied = [n for n in names if any(re.search(p, n) for p in tied_patterns)]
            keep = [n for n in names if n not in tied] or tied[-1:]
            if len(keep) > 1:
                raise ExportError(
                    f"model: {keep} are one tensor but none is declared in `_tied_weights_keys`, so "
                    "from_pretrained would not tie them again; declare the tie or clone the weights"
                )
            drop.update(n for n in names if n not in keep)
    return {k: v for k, v in state.items() if k not in drop}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] a tensor view covers in its storage."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


# ---------------------------------------------------------------------------------------------
# the directory
# ---------------------------------------------------------------------------------------------
def _check_out_dir(out_dir: str | os.PathLike[str]) -> Path:
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
        raise ExportError(f"out_dir={out_dir!r}: expected a directory path")
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ExportError(f"out_dir={out}: exists and is not a directory")
    if Path.cwd().is_relative_to(out):
        raise ExportError(f"out_dir={out}: is (or contains) the working directory; export to a subdirectory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ExportError(
            f"out_dir={out}: not empty and not a previous export (no config.json); refusing to replace it, "
            "pick a new directory"
        )
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ExportError(f"out_dir={out}: {parent} is a file, not a directory")
            break
    return out
