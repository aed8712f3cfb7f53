# python recipes/benchmark_checkpoint_checksum.py --mb 512 --repeats 3 --dir /tmp/ckpt-bench
"""What the checkpoint checksums cost: save and load of a checkpoint with and without them, in ms per GB.

A checkpoint shaped like MegaTrainStrategy's (``--mb`` MB in all: fp32 weights as views of one flat
buffer, Adam's two moments as views of another, a few small tensors) is saved and loaded through
``ShardedCheckpointIO`` in both formats:

- directory: ``write_shard`` (CRC32 on a helper thread, one chunk behind the write) against
  ``safetensors.torch.save_file`` (no checksum; the previous writer), and ``read_shard`` (CRC32 checked
  as the bytes stream in) against ``read_unverified`` (the same plain reads, header checks only);
- single file: ``torch.save`` (which always records zip CRC32s), and ``load_checkpoint``'s CRC pass
  (``_verify_torch_file``) against ``torch.load`` alone;
- the CRC32 itself over the bytes in memory (``zlib.crc32``, one thread).

Reads come from the page cache (the files were just written): the worst case for the checksums' share,
since the disk costs nothing there. Prints best-of-``--repeats`` times and ms/GB.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import time
import zlib
from pathlib import Path

import safetensors.torch
import torch

from megatrain_lightning import checkpoint_io as cio
from megatrain_lightning.shard_file import byte_view, read_shard, read_unverified, write_shard


def checkpoint(total_mb: int) -> dict:
    n = total_mb * 2**20 // 12  # fp32 weights + two fp32 moments: 12 B per parameter
    flat, moments = torch.randn(n), torch.randn(2, n)
    views = flat.split(n // 64)
    m = [moments[0].split(n // 64), moments[1].split(n // 64)]
    return {
        "state_dict": {f"layers.{i}.weight": v for i, v in enumerate(views)},
        "optimizer_states": [{"state": {i: {"step": torch.tensor(3.0), "exp_avg": m[0][i], "exp_avg_sq": m[1][i]}
                                        for i in range(len(views))}, "param_groups": [{"lr": 1e-3, "params": list(range(len(views)))}]}],
        "epoch": 0,
    }


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckpt-bench")
    ap.add_argument("--shard-mb", type=int, default=128)
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ck = checkpoint(args.mb)
    gb = cio._storage_bytes(ck) / 1e9
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; checkpoint {gb:.3f} GB; shards of {args.shard_mb} MiB; best of {args.repeats}")

    # the CRC alone, in memory
    flat_bytes = byte_view(torch.randn(2**27))  # 512 MiB
    t = best(lambda: zlib.crc32(flat_bytes), args.repeats)
    print(f"{'crc32 in memory, one thread':34s} {t * 1e3:8.1f} ms  {t / (len(flat_bytes) / 1e9) * 1e3:7.0f} ms/GB")
    del flat_bytes

    # directory format: shard by shard
    io = cio.ShardedCheckpointIO(max_shard_bytes=args.shard_mb * 2**20, single_file_max_bytes=0)
    shards: list[dict] = []  # the shards the directory format writes (tensors as the writer hands them over)
    writer = cio._ShardWriter(root, io.max_shard_bytes)
    real = cio._write_shard
    cio._write_shard = lambda tensors, path: shards.append(dict(tensors)) or real(tensors, path)  # type: ignore[assignment]
    writer.replace_tensors(ck)
    writer.flush()
    cio._write_shard = real  # type: ignore[assignment]
    entries = {f"s{i}.safetensors": e for i, e in enumerate(writer.entries.values())}

    def save(checked: bool) -> None:
        for i, tensors in enumerate(shards):
            path = root / f"s{i}.safetensors"
            write_shard(tensors, path) if checked else safetensors.torch.save_file(tensors, str(path))

    def load(checked: bool) -> None:
        for name, entry in entries.items():
            read_shard(root / name, entry) if checked else read_unverified(root / name)

    rows = [("directory save, no checksum", best(lambda: save(False), args.repeats)),
            ("directory save, CRC32", best(lambda: save(True), args.repeats))]
    rows += [("directory load, no checksum", best(lambda: load(False), args.repeats)),  # the files save(True) wrote
             ("directory load, CRC32 checked", best(lambda: load(True), args.repeats))]

    # single file
    single = root / "one.ckpt"
    rows.append(("single file save (torch.save)", best(lambda: torch.save(ck, single), args.repeats)))
    rows.append(("single file load, torch.load alone", best(lambda: torch.load(single, weights_only=True), args.repeats)))
    rows.append(("single file CRC32 pass", best(lambda: cio._verify_torch_file(single), args.repeats)))
    for label, t in rows:
        print(f"{label:34s} {t * 1e3:8.1f} ms  {t / gb * 1e3:7.0f} ms/GB")
    d = dict(rows)
    print(f"checksum cost: save +{(d['directory save, CRC32'] - d['directory save, no checksum']) / gb * 1e3:.0f} ms/GB, "
          f"load +{(d['directory load, CRC32 checked'] - d['directory load, no checksum']) / gb * 1e3:.0f} ms/GB (directory); "
          f"single-file load +{d['single file CRC32 pass'] / gb * 1e3:.0f} ms/GB")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
