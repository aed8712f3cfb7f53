"""Lightning checkpoints that lose nothing: one torch file when small, a directory of checksummed
safetensors shards when large; both published atomically and verified before anything is restored.

    trainer = Trainer(strategy=MegaTrainStrategy())            # uses ShardedCheckpointIO() by default
    trainer = Trainer(strategy=MegaTrainStrategy(checkpoint_io=ShardedCheckpointIO(max_shard_bytes=2**30)))

Two formats, picked per save by the bytes the checkpoint's tensors hold (docs/checkpoints.md):

- **Single file** (at most ``single_file_max_bytes``, by default one shard's worth): exactly what
  ``torch.save`` writes, so Lightning's and torch's own entry points read it
  (``MyModule.load_from_checkpoint(path)``, ``Trainer(strategy="auto").fit(ckpt_path=path)``,
  ``torch.load``). It is written straight to a hidden sibling file (``torch.save`` streams each storage
  from its own memory; Lightning's ``TorchCheckpointIO`` first pickles everything into a ``BytesIO``,
  a second copy of the checkpoint), fsynced and renamed into place. Its integrity check is the CRC32
  that ``torch.save`` records for every zip entry and ``torch.load`` does not check: this loader does.
- **Directory** (larger): every tensor found in the checkpoint (``state_dict``, optimizer states,
  callback states, anything in nested dicts, lists and tuples) goes into ``shard-0000i.safetensors``
  files of at most ``max_shard_bytes``, written one at a time straight from the host store; the rest,
  with each tensor replaced by a small placeholder, goes into ``meta.pt``; ``index.json`` records the
  byte size and CRC32 of every file and the dtype, shape, byte size and offsets of every tensor, and a
  CRC32 of itself. Saving costs about ``max_shard_bytes`` of host memory, not the checkpoint. Lightning's
  readers cannot open a directory: ``python -m megatrain_lightning.consolidate DIR OUT.ckpt`` streams it
  into a single file they can.

Atomicity (``atomic_dir``): a save is written into a hidden ``.NAME.tmp-*`` sibling and swapped in
under its name in one step, so the name always holds a complete checkpoint (the previous or the new
one); a removal renames the directory to ``.NAME.del-*`` before deleting its files. What a hard kill
leaves behind is tidied at the next start: the first save or removal through a ShardedCheckpointIO in
a directory, and MegaTrainStrategy's setup for each ModelCheckpoint directory. Readers never tidy.

Loading (:meth:`ShardedCheckpointIO.load_checkpoint`) checks every byte before it returns, so a damaged
checkpoint is refused (:class:`~megatrain_lightning.errors.CheckpointError`, naming the file) before any
model or optimizer state is touched; and it reads into owned memory (plain reads, no ``mmap``), so once
the run drops the loaded dict nothing of the checkpoint stays mapped and deleting it frees its disk.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import pickle
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from typing_extensions import override

from . import atomic_dir
from .errors import CheckpointError
from .shard_file import CHUNK, dtype_name, read_shard, read_unverified, write_shard

log = logging.getLogger(__name__)

META_NAME = "meta.pt"
INDEX_NAME = "index.json"
SHARD_NAME = "shard-{:05d}.safetensors"
# A placeholder is a plain dict (so `torch.load(weights_only=True)` reads meta.pt) marked by this key,
# whose value is the format version.
_PLACEHOLDER = "__megatrain_sharded_tensor__"
_FORMAT = "megatrain-sharded-checkpoint"
_FORMAT_VERSION = 2  # 1: no index.json, no checksums (still read)
# dtypes safetensors stores; a tensor of another dtype or layout (sparse, complex) stays in meta.pt.
_SHARDABLE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
}
_WHAT_TO_DO = "resume from an earlier checkpoint (or delete this one)"


class ShardedCheckpointIO(CheckpointIO):
    """Save Lightning checkpoints as one torch file (small) or a directory of checksummed safetensors
    shards (large), atomically; load either (and Lightning's own ``.ckpt`` files) after checking them.

    Args:
        max_shard_bytes: the largest shard file of a directory checkpoint (a single larger tensor gets a
            shard of its own). It also bounds the host memory a save needs: tensors that must be copied
            (non-contiguous, on a device, overlapping another in the same shard) are copied only into
            the shard being filled. Smaller shards: less memory and more files; 2 GiB keeps a 7B
            checkpoint at ~60 files.
        single_file_max_bytes: checkpoints whose tensors hold at most this many bytes (counting each
            storage once, as ``torch.save`` writes them) are saved as a single ``torch.save`` file,
            which Lightning's ``load_from_checkpoint`` and other strategies read as they are; larger
            ones as a directory. ``None``: ``max_shard_bytes`` (a checkpoint that fits one shard is one
            file). ``0``: always a directory.
    """

    def __init__(self, max_shard_bytes: int = 2 * 2**30, single_file_max_bytes: int | None = None) -> None:
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes={max_shard_bytes!r}: expected a positive number of bytes")
        if single_file_max_bytes is not None and (not isinstance(single_file_max_bytes, int) or single_file_max_bytes < 0):
            raise ValueError(f"single_file_max_bytes={single_file_max_bytes!r}: expected a number of bytes >= 0, or None")
        self.max_shard_bytes = max_shard_bytes
        self.single_file_max_bytes = max_shard_bytes if single_file_max_bytes is None else single_file_max_bytes
        self._tidied: set[Path] = set()

    # ------------------------------------------------------------------ Lightning's interface
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` at ``path`` (a file or a directory, by size), replacing what is there
        only once the new one is complete."""
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}; "
                "pass storage_options=None"
            )
        out = _local_path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        self.tidy(out.parent)
        tmp = atomic_dir.sibling(out, "tmp")
        try:
            if _storage_bytes(checkpoint) <= self.single_file_max_bytes:
                _save_file(checkpoint, tmp)
            else:
                _save_directory(checkpoint, tmp, self.max_shard_bytes)
            atomic_dir.replace(tmp, out)
        except BaseException:  # KeyboardInterrupt too: the previous checkpoint must survive any interruption
            atomic_dir.discard(tmp)
            raise
        finally:
            atomic_dir.release(tmp)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save_checkpoint` (either format) or any ``torch.save``
        file, after checking every byte: the CRC32s of a directory's ``index.json``, ``meta.pt`` and
        shards (as the bytes stream in, with the header of each shard matched against the index), or the
        zip CRC32s of a single file. Refuses a damaged checkpoint with a CheckpointError naming the file,
        before returning anything.

        Tensors come back in memory the process owns: shards are read with plain reads into fresh
        tensors, never ``mmap``-ed (as ``safetensors.safe_open`` would), so nothing of the checkpoint
        stays mapped once the caller drops the dict, and deleting it frees its disk space. Directory
        tensors are contiguous, each with its own memory (views that shared storage when saved no longer
        do; the same tensor referenced twice is one tensor again). ``map_location``, when a device or
        device string, moves them there. ``weights_only`` is handed to ``torch.load`` (``None``: torch's
        default, ``True`` since torch 2.6); a checkpoint it refuses is reported with what to pass.
        """
        src = _local_path(path)
        if not src.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if src.is_file():
            _verify_torch_file(src)
            return _torch_load(src, src, map_location, weights_only)
        if (src / INDEX_NAME).is_file():
            return _load_directory(src, map_location, weights_only)
        if (src / META_NAME).is_file():
            return _load_directory_v1(src, map_location, weights_only)
        raise _not_a_checkpoint(src)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove a checkpoint (directory, file, or a link to either). A directory's name goes first
        (renamed to a hidden ``.NAME.del-*``), then its files: a kill never leaves a half-deleted
        checkpoint under its name."""
        target = _local_path(path)
        self.tidy(target.parent)
        atomic_dir.remove(target)

    def tidy(self, directory: _PATH) -> list[str]:
        """Once per directory and instance: delete the hidden ``.NAME.tmp-*``, ``.NAME.old-*`` and
        ``.NAME.del-*`` siblings a hard kill left in ``directory`` and give back a checkpoint's name
        where a kill came between the two renames of a replace (see ``atomic_dir.tidy``)."""
        d = _local_path(directory)
        if d in self._tidied:
            return []
        self._tidied.add(d)
        return atomic_dir.tidy(d)


# ---------------------------------------------------------------------------------------------
# the single-file format
# ---------------------------------------------------------------------------------------------
def _not_a_checkpoint(src: Path) -> CheckpointError:
    found = sorted(str(p) for p in src.glob("**/*.ckpt"))[:3]
    return CheckpointError(
        f"{src}: a directory without {INDEX_NAME} or {META_NAME}, so not a checkpoint written by "
        f"{ShardedCheckpointIO.__name__}"
        + (f" (a run directory? it holds {', '.join(found)}): pass one of those" if found else
           f": pass a checkpoint ModelCheckpoint wrote (a .ckpt file or directory), or {_WHAT_TO_DO}")
    )


def checkpoint_keys(path: _PATH) -> list[str] | None:
    """The top-level keys of a checkpoint (``state_dict``, ``loops``, ...), read without its tensors: a directory's
    index and ``meta.pt``, a file's pickle with its tensors mapped, not read. For a run to see whether it was given
    a Lightning checkpoint before it builds anything (the load proper checks every byte). None where it cannot tell
    that cheaply: ``torch.load(weights_only=True)`` refuses an object in it, or a pre-1.6 (non-zip) torch file."""
    src = _local_path(path)
    try:
        if src.is_dir():
            if (src / INDEX_NAME).is_file():
                top = read_meta(src, read_index(src), "cpu", True)
            elif (src / META_NAME).is_file():
                top = _torch_load(src / META_NAME, src / META_NAME, "cpu", True)["checkpoint"]
            else:
                raise _not_a_checkpoint(src)
        else:
            if not _is_zip(src):
                return None
            top = _torch_load(src, src, "cpu", True, mmap=True)
    except _WeightsOnlyRefused:
        return None
    return sorted(str(k) for k in top) if isinstance(top, dict) else []


def _storage_bytes(obj: Any) -> int:
    """What ``torch.save`` would write for the tensors found in dicts, lists and tuples: each storage
    once, whole (a view saves its entire storage)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in _tensors(obj):
        if t.is_meta or t.layout != torch.strided:
            continue
        s = t.untyped_storage()
        ident = (str(t.device), s.data_ptr())
        if ident not in seen:
            seen.add(ident)
            total += s.nbytes()
    return total


def _save_file(checkpoint: dict[str, Any], tmp: Path) -> None:
    torch.save(checkpoint, tmp)  # streamed: each storage is written from its own memory, in turn
    atomic_dir.fsync_file(tmp)


def _verify_torch_file(path: Path) -> None:
    """Check every entry of a ``torch.save`` zip against the CRC32 written with it (``torch.load``
    does not), streaming. A pre-1.6 (non-zip) torch file has none and is read as it is."""
    if not _is_zip(path):
        return
    try:
        with zipfile.ZipFile(path) as z:
            infos = [i for i in z.infolist() if i.file_size]
            if infos and all(i.CRC == 0 for i in infos):
                log.warning("%s: written with torch's CRC32 switched off; its bytes cannot be checked", path)
                return
            for info in infos:
                with z.open(info) as r:  # raises BadZipFile at the end of an entry whose CRC32 differs
                    while r.read(CHUNK):
                        pass
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise CheckpointError(f"{path}: damaged or truncated ({err}); {_WHAT_TO_DO}") from None


def _is_zip(path: Path) -> bool:
    """Whether a torch file is a zip (torch >= 1.6); False for a legacy one, a pickle (protocol 2+); anything else
    refused by name."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04" and magic[:1] != b"\x80":
        raise CheckpointError(f"{path}: not a torch checkpoint (neither a zip nor a pickle); {_WHAT_TO_DO}")
    return magic == b"PK\x03\x04"


class _WeightsOnlyRefused(CheckpointError, pickle.UnpicklingError):
    """torch.load(weights_only=True) refused an object in the checkpoint (still a pickle.UnpicklingError)."""


def _torch_load(source: Any, name: Path, map_location: Any, weights_only: bool | None, mmap: bool = False) -> Any:
    try:
        if isinstance(source, Path) and not mmap:
            return pl_load(source, map_location=map_location, weights_only=weights_only)
        return torch.load(source, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except (RuntimeError, EOFError, zipfile.BadZipFile) as err:
        # torch's zip reader checks fields Python's zipfile (_verify_torch_file) does not: a damaged zip64 record
        if isinstance(err, RuntimeError) and "PytorchStreamReader" not in str(err) and "zip" not in str(err).lower():
            raise
        raise CheckpointError(f"{name}: damaged or truncated ({_first_line(err)}); {_WHAT_TO_DO}") from err
    except pickle.UnpicklingError as err:
        if weights_only is False or "Weights only load failed" not in str(err):
            raise CheckpointError(f"{name}: not readable as a torch checkpoint ({_first_line(err)}); {_WHAT_TO_DO}") from err
        raise _WeightsOnlyRefused(
            f"{name}: torch.load(weights_only=True) refuses an object in this checkpoint ({_first_line(err)}). "
            "If you trust its source, load it with weights_only=False: Trainer.fit(model, ckpt_path=..., "
            "weights_only=False) (also validate/test/predict), or load_checkpoint(path, weights_only=False)"
        ) from err


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return next((line.strip() for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")


# ---------------------------------------------------------------------------------------------
# the directory format: writing
# ---------------------------------------------------------------------------------------------
def _write_shard(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """One shard file, written from each tensor's own memory, no copy; returns its index entry. Tests
    interrupt a save here."""
    return write_shard(tensors, path)


def _save_directory(checkpoint: dict[str, Any], tmp: Path, max_shard_bytes: int) -> None:
    tmp.mkdir()
    writer = _ShardWriter(tmp, max_shard_bytes)
    skeleton = writer.replace_tensors(checkpoint)
    writer.flush()
    buf = io.BytesIO()  # small: every shardable tensor is a placeholder now
    torch.save({"format_version": _FORMAT_VERSION, "checkpoint": skeleton}, buf)
    meta = buf.getvalue()
    (tmp / META_NAME).write_bytes(meta)
    files = {META_NAME: {"bytes": len(meta), "crc32": f"{zlib.crc32(meta):08x}"}, **writer.entries}
    index: dict[str, Any] = {"format": _FORMAT, "format_version": _FORMAT_VERSION, "checksum": "crc32", "files": files}
    index["index_crc32"] = _index_crc(index)
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1))
    atomic_dir.fsync_tree(tmp)


def _index_crc(index: dict[str, Any]) -> str:
    body = {k: v for k, v in index.items() if k != "index_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


class _ShardWriter:
    """Fills shards in the order tensors are met and writes each when the next tensor would overflow it.

    Buffer lifetime: `self.shard` holds the only references to the copies it made; `flush` drops them.
    """

    def __init__(self, directory: Path, max_shard_bytes: int) -> None:
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.n_shards = 0
        self.entries: dict[str, dict[str, Any]] = {}  # shard file -> its index entry
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
            "dtype": dtype_name(t.dtype),
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
        name = SHARD_NAME.format(self.n_shards)
        self.entries[name] = _write_shard(self.shard, self.directory / name)
        self.shard, self.shard_bytes, self.spans = {}, 0, {}  # the shard's copies are freed here


# ---------------------------------------------------------------------------------------------
# the directory format: reading
# ---------------------------------------------------------------------------------------------
def read_index(src: Path) -> dict[str, Any]:
    """``index.json`` of a directory checkpoint, checked against its own CRC32 and the files' sizes
    (a truncated or missing shard is found here, before anything is read)."""
    path = src / INDEX_NAME
    try:
        index = json.loads(path.read_bytes())
        ok = isinstance(index, dict) and index.get("format") == _FORMAT and index.get("index_crc32") == _index_crc(index)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: damaged (not the index this checkpoint was written with); {_WHAT_TO_DO}")
    if index["format_version"] > _FORMAT_VERSION:
        raise CheckpointError(f"{src}: format version {index['format_version']}, newer than this megatrain_lightning reads; upgrade it")
    for name, entry in index["files"].items():
        try:
            size = (src / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{src / name}: missing from the checkpoint; {_WHAT_TO_DO}") from None
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{src / name}: {size} bytes where {entry['bytes']} were written "
                f"({'truncated' if size < entry['bytes'] else 'overwritten'}); {_WHAT_TO_DO}"
            )
    return index


def read_meta(src: Path, index: dict[str, Any], map_location: Any, weights_only: bool | None) -> Any:
    """The checkpoint's structure from ``meta.pt`` (placeholders where the tensors go), after its CRC32
    and the placeholders' agreement with the index are checked."""
    path = src / META_NAME
    raw = path.read_bytes()  # small: a few KB plus whatever is not a tensor
    entry = index["files"][META_NAME]
    if f"{zlib.crc32(raw):08x}" != entry["crc32"] or len(raw) != entry["bytes"]:
        raise CheckpointError(f"{path}: damaged (its CRC32 differs from the one written); {_WHAT_TO_DO}")
    meta = _torch_load(io.BytesIO(raw), path, map_location, weights_only)
    skeleton = meta["checkpoint"]
    for ph in _placeholders(skeleton):
        spec = index["files"].get(ph["shard"], {}).get("tensors", {}).get(ph["key"])
        if spec is None or spec["dtype"] != ph["dtype"] or spec["shape"] != ph["shape"]:
            raise CheckpointError(f"{path}: tensor {ph['shard']}/{ph['key']} is {ph}, the index says {spec}; {_WHAT_TO_DO}")
    return skeleton


def _load_directory(src: Path, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    index = read_index(src)
    skeleton = read_meta(src, index, map_location, weights_only)
    loaded: dict[tuple[str, str], torch.Tensor] = {}
    for name, entry in index["files"].items():  # one file open at a time
        if name == META_NAME:
            continue
        try:
            tensors = read_shard(src / name, entry)
        except CheckpointError as err:
            raise CheckpointError(f"{err}; {_WHAT_TO_DO}") from None
        for key, t in tensors.items():
            loaded[(name, key)] = t
    return _fill(skeleton, _moved(loaded, map_location))


def _load_directory_v1(src: Path, map_location: Any, weights_only: bool | None) -> dict[str, Any]:
    """Format 1 (before index.json): no checksums; only the shards' headers are checked."""
    log.warning("%s: written by an earlier megatrain_lightning without checksums; its bytes cannot be verified", src)
    try:
        meta = _torch_load(src / META_NAME, src / META_NAME, map_location, weights_only)
    except (RuntimeError, EOFError) as err:
        raise CheckpointError(f"{src / META_NAME}: damaged or truncated ({_first_line(err)}); {_WHAT_TO_DO}") from None
    if meta.get("format_version", 1) >= 2:  # written with index.json, which is gone: nothing can be verified
        raise CheckpointError(f"{src}: {INDEX_NAME} is missing, and this checkpoint was written with one (format "
                              f"{meta['format_version']}): its checksums are lost, so its bytes cannot be verified; "
                              f"{_WHAT_TO_DO}")
    skeleton = meta["checkpoint"]
    loaded: dict[tuple[str, str], torch.Tensor] = {}
    for shard in sorted({ph["shard"] for ph in _placeholders(skeleton)}):
        for key, t in read_unverified(src / shard).items():
            loaded[(shard, key)] = t
    return _fill(skeleton, _moved(loaded, map_location))


def _moved(loaded: dict[tuple[str, str], torch.Tensor], map_location: Any) -> dict[tuple[str, str], torch.Tensor]:
    if not isinstance(map_location, (str, torch.device)):
        return loaded
    return {k: t.to(map_location) for k, t in loaded.items()}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


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
# paths
# ---------------------------------------------------------------------------------------------
def _local_path(path: _PATH) -> Path:
    if "://" in str(path):
        raise ValueError(
            f"{path}: ShardedCheckpointIO writes local directories only; for remote storage pass "
            "checkpoint_io=TorchCheckpointIO() (which holds the whole checkpoint in memory while saving)"
        )
    return Path(path).expanduser().absolute()
