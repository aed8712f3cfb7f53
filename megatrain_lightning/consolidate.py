"""Turn a directory checkpoint into the single ``torch.save`` file that Lightning's own readers open.

    python -m megatrain_lightning.consolidate checkpoints/epoch=3-step=400.ckpt model.ckpt

``MyModule.load_from_checkpoint("model.ckpt")``, ``Trainer(strategy="auto").fit(model, ckpt_path="model.ckpt")``
and ``torch.load`` then read it; megatrain reads either. The role of DeepSpeed's
``convert_zero_checkpoint_to_fp32_state_dict``, without its cost: that one gathers the whole state dict
in memory before ``torch.save``. Here every check of a load runs first (index, ``meta.pt`` and each
shard's CRC32, streamed through two small buffers), then each tensor becomes a copy-on-write memory map
of its bytes in its shard and ``torch.save`` writes from those maps, one storage after the other, into
a hidden sibling of the output, which is fsynced and renamed into place. The maps are file-backed pages
the kernel can drop at any time, so the process's own (anonymous) memory stays near ``meta.pt``'s size,
whatever the checkpoint's; it needs disk for the output (the checkpoint's size again).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import atomic_dir
from .checkpoint_io import INDEX_NAME, META_NAME, _fill, _local_path, read_index, read_meta
from .errors import CheckpointError
from .shard_file import verify_shard

log = logging.getLogger(__name__)


def consolidate(src: str | Path, out: str | Path, weights_only: bool = True) -> Path:
    """Write the directory checkpoint ``src`` as one ``torch.save`` file ``out`` (replaced atomically if
    it exists). ``weights_only``: how ``meta.pt`` (hyperparameters, loop state) is unpickled; pass False
    for a trusted checkpoint whose hyperparameters hold objects (a transformers config, say)."""
    src_dir, out_file = _local_path(src), _local_path(out)
    if not (src_dir / INDEX_NAME).is_file():
        what = "a single file already" if src_dir.is_file() else f"not a directory checkpoint (no {INDEX_NAME})"
        raise CheckpointError(f"{src_dir}: {what}; nothing to consolidate")
    if out_file == src_dir or src_dir in out_file.parents:
        raise CheckpointError(f"{out_file}: inside the checkpoint it is made from; pick a path outside {src_dir}")
    index = read_index(src_dir)
    skeleton = read_meta(src_dir, index, None, weights_only)
    maps: dict[tuple[str, str], torch.Tensor] = {}
    for name, entry in index["files"].items():
        if name == META_NAME:
            continue
        start = verify_shard(src_dir / name, entry)
        for key, spec in entry["tensors"].items():
            maps[(name, key)] = _mapped(src_dir / name, start + spec["offsets"][0], spec)
    checkpoint = _fill(skeleton, maps)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic_dir.sibling(out_file, "tmp")
    try:
        torch.save(checkpoint, tmp)  # reads each map in turn: pages come from the shard, stay reclaimable
        atomic_dir.fsync_file(tmp)
        atomic_dir.replace(tmp, out_file)
    except BaseException:
        atomic_dir.discard(tmp)
        raise
    finally:
        atomic_dir.release(tmp)
    return out_file


def _mapped(path: Path, offset: int, spec: dict[str, Any]) -> torch.Tensor:
    """A tensor over its bytes in the shard file: a private (copy-on-write) map, never written."""
    dtype = getattr(torch, spec["dtype"])
    if spec["bytes"] == 0:
        return torch.empty(spec["shape"], dtype=dtype)
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(spec["bytes"],))
    return torch.from_numpy(raw).view(dtype).reshape(spec["shape"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatrain_lightning.consolidate",
        description="Write a megatrain directory checkpoint as one torch.save file (for load_from_checkpoint, "
        "Trainer(strategy='auto'), torch.load).",
    )
    parser.add_argument("src", help="the checkpoint directory (e.g. checkpoints/last.ckpt)")
    parser.add_argument("out", help="the file to write (replaced atomically if it exists)")
    parser.add_argument(
        "--weights-only", action=argparse.BooleanOptionalAction, default=True,
        help="unpickle meta.pt with torch.load(weights_only=True) (default); --no-weights-only for a trusted "
        "checkpoint whose hyperparameters hold objects",
    )
    args = parser.parse_args(argv)
    try:
        out = consolidate(args.src, args.out, weights_only=args.weights_only)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
