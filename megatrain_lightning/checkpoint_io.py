"""Lightning checkpoints as a directory of safetensors shards, written one shard at a time, atomically.

    trainer = Trainer(strategy=MegaTrainStrategy())            # uses ShardedCheckpointIO() by default
    trainer = Trainer(strategy=MegaTrainStrategy(checkpoint_io=ShardedCheckpointIO(max_shard_bytes=2**30)))

Lightning's default `TorchCheckpointIO` pickles the whole checkpoint into an in-memory `BytesIO` before
writing it (`lightning.fabric.utilities.cloud_io._atomic_save`): for a 7B model with fp32 Adam state that
is a second ~120 GB copy of everything the host holds. Here every tensor found in the checkpoint
(`state_dict`, `optimizer_states[i]["state"]`, callback states, anything in nested dicts, lists and
tuples) goes into `shard-0000i.safetensors` files, written one at a time; the remaining structure, with
each tensor replaced by a small placeholder naming its shard and key, goes into `meta.pt`. Contiguous
host tensors (the strategy's parameter and Adam-moment views into its flat buffers) are written straight
from their own memory, no copy; only non-contiguous, device or overlapping tensors are copied, at most
one shard's worth at a time. So saving costs about `max_shard_bytes` of host memory, not the checkpoint.

The checkpoint path (`epoch=0-step=3.ckpt`) is a directory, as DeepSpeed's are. It is written into a
temporary sibling (`.NAME.tmp-*`), fsynced, and renamed into place only when complete; an existing
checkpoint at that path is moved aside and deleted only after the new one is in place. An exception or
KeyboardInterrupt mid-save leaves the previous checkpoint as it was (a hard kill can leave a `.NAME.tmp-*`
or, between the two renames, the previous checkpoint in `.NAME.old-*`; both are safe to delete).

Loading rebuilds the dict shard by shard (the whole checkpoint is then in memory once, as Lightning's
restore needs it); a plain single-file Lightning `.ckpt` still loads with `torch.load`.
"""

from __future__ import annotations


import copy
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from safetensors import safe_open
from typing_extensions import override

from .atomic_dir import fsync_tree, replace

META_NAME = "meta.pt"
SHARD_NAME = "shard-{:05d}.safetensors"
# A placeholder is a plain dict (so `torch.load(weights_only=True)` reads meta.pt) marked by this key,
# whose value is the format version.
_PLACEHOLDER = "__megatrain_sharded_tensor__"
_FORMAT_VERSION = 1
# dtypes safetensors stores; a tensor of another dtype or layout (sparse, complex) stays in meta.pt.
_SHARDABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}


class ShardedCheckpointIO(CheckpointIO):
    """Save Lightning checkpoints as a directory of safetensors shards plus a small `meta.pt`.

    Args:
        max_shard_bytes: the largest shard file (a single larger tensor gets a shard of its own). It also
            bounds the host memory a save needs: tensors that must be copied (non-contiguous, on a
            device, overlapping another in the same shard) are copied only into the shard being filled.
            Smaller shards: less memory and more files; 2 GiB keeps a 7B checkpoint at ~60 files.
    """

    def __init__(self, max_shard_bytes: int = 2 * 2**30) -> None:
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes!r}: expected a positive number of bytes")
        self.max_shard_bytes = max_shard_bytes

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write `checkpoint` as the directory `path`, replacing what is there only once it is complete."""
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}; "
                "pass storage_options=None"
            )
        out = _local_path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            writer = _ShardWriter(tmp, self.max_shard_bytes)
            skeleton = writer.replace_tensors(checkpoint)
            writer.flush()
            torch.save({"format_version": _FORMAT_VERSION, "checkpoint": skeleton}, tmp / META_NAME)
            fsync_tree(tmp)
            replace(tmp, out)
        except BaseException:  # KeyboardInterrupt too: the previous checkpoint must survive any interruption
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Rebuild the checkpoint dict from a directory written by `save_checkpoint`, or `torch.load` a
        single-file `.ckpt`. Tensors come back contiguous and each with its own memory (views that
        shared storage when saved no longer do; the same tensor referenced twice is one tensor again).
        `map_location`, when a device or device string, moves the shards' tensors there; otherwise they
        are host tensors."""
        src = _local_path(path)
        if not src.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if src.is_file():
            return pl_load(src, map_location=map_location, weights_only=weights_only)
        meta_path = src / META_NAME
        if not meta_path.is_file():
            raise FileNotFoundError(f"{src} is a directory without {META_NAME}: not a checkpoint written by {type(self).__name__}")
        meta = pl_load(meta_path, map_location=map_location, weights_only=weights_only)
        skeleton = meta["checkpoint"]
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        wanted: dict[str, set[str]] = {}
        for ph in _placeholders(skeleton):
            wanted.setdefault(ph["shard"], set()).add(ph["key"])
        loaded: dict[tuple[str, str], torch.Tensor] = {}
        for shard, keys in sorted(wanted.items()):  # one file open at a time
            with safe_open(str(src / shard), framework="pt", device="cpu") as f:
                for key in keys:
                    t = f.get_tensor(key)
                    loaded[(shard, key)] = t.to(device) if device is not None else t
        return _fill(skeleton, loaded)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint directory (or a single-file checkpoint, or a link to either)."""
        target = _local_path(path)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One shard file. safetensors (>= 0.6) writes from each tensor's own memory, no copy. Tests interrupt
    a save here."""
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})


class _ShardWriter:
    """Fills shards in the order tensors are met and writes each when the next tensor would overflow it.

    Buffer lifetime: `self.shard` holds the only references to the copies it made; `flush` drops them.
    """

    def __init__(self, directory: Path, max_shard_bytes: int) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.n_shards = 0
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.spans: dict[int, list[tuple[int, int]]] = {}  # storage pointer -> byte spans in this shard
        self.seen: dict[tuple[Any, ...], dict[str, Any]] = {}  # an identical view -> its placeholder
        self.n_tensors = 0

    def replace_tensors(self, obj: Any) -> Any:
        """A copy of `obj`'s container structure with every shardable tensor replaced by a placeholder;
        the original is left untouched. Objects other than dicts, lists and tuples are kept as they are
        (torch.save pickles them, with any tensors inside them, into meta.pt)."""
        if isinstance(obj, torch.Tensor):
            return self.add(obj)
        if isinstance(obj, dict):
            new = copy.copy(obj)  # keeps the dict's class (OrderedDict, AttributeDict, defaultdict)
            for k, v in obj.items():
                new[k] = self.replace_tensors(v)
            return new
        if isinstance(obj, list):
            return [self.replace_tensors(v) for v in obj]
        if isinstance(obj, tuple):
            items = [self.replace_tensors(v) for v in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuple or tuple
        return obj

    def add(self, tensor: torch.Tensor) -> Any:
        t = tensor.detach()
        if t.layout != torch.strided or t.dtype not in _SHARDABLE or t.is_meta:
            return tensor  # pickled into meta.pt as is
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
        if ident is not None and ident in self.seen:
            return self.seen[ident]  # the same view again (tied weights): stored once, one tensor on load
        nbytes = t.numel() * t.element_size()
        if self.shard and self.shard_bytes + nbytes > self.max_shard_bytes:
            self.flush()  # before copying the next tensor: never a full shard plus one more
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.to("cpu").contiguous()  # a copy, freed when its shard is written
        elif t.numel() and self._overlaps(t):
            t = t.clone()  # safetensors refuses overlapping tensors in one file
        if t.numel():
            self.spans.setdefault(t.untyped_storage().data_ptr(), []).append((t.data_ptr(), t.data_ptr() + nbytes))
        key = str(self.n_tensors)
        self.n_tensors += 1
        self.shard[key] = t
        self.shard_bytes += nbytes
        ph = {
            _PLACEHOLDER: _FORMAT_VERSION,
            "shard": SHARD_NAME.format(self.n_shards + 1),
            "key": key,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
        if ident is not None:
            self.seen[ident] = ph
        return ph

    def _overlaps(self, t: torch.Tensor) -> bool:
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(s < end and start < e for s, e in self.spans.get(t.untyped_storage().data_ptr(), ()))

    def flush(self) -> None:
        if not self.shard:
            return
        self.n_shards += 1
        _write_shard(self.shard, self.directory / SHARD_NAME.format(self.n_shards))
        self.shard, self.shard_bytes, self.spans = {}, 0, {}  # the shard's copies are freed here


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def _is_placeholder(obj: Any) -> bool:
    return type(obj) is dict and _PLACEHOLDER in obj


def _placeholders(obj: Any) -> Iterator[dict[str, Any]]:
    if _is_placeholder(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _placeholders(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _placeholders(v)


def _fill(obj: Any, loaded: dict[tuple[str, str], torch.Tensor]) -> Any:
    """Put the loaded tensors back in place of their placeholders (in place: the skeleton is ours)."""
    if _is_placeholder(obj):
        return loaded[(obj["shard"], obj["key"])]
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _fill(v, loaded)
        return obj
    if isinstance(obj, list):
        obj[:] = [_fill(v, loaded) for v in obj]
        return obj
    if isinstance(obj, tuple):
        items = [_fill(v, loaded) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


# ---------------------------------------------------------------------------------------------
# the directory
# ---------------------------------------------------------------------------------------------
def _local_path(path: _PATH) -> Path:
    if "://" in str(path):
        raise ValueError(
            f"{path}: ShardedCheckpointIO writes local directories only; for remote storage pass "
            "checkpoint_io=TorchCheckpointIO() (which holds the whole checkpoint in memory while saving)"
        )
    return Path(path).expanduser().absolute()
