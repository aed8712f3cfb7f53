"""One safetensors shard, written and read as a stream, with a CRC32 of every byte of the file.

    entry = write_shard({"0": w, "1": b}, path)   # {"bytes", "crc32", "tensors": {key: dtype, shape, ...}}
    tensors = read_shard(path, entry)             # refuses a file that differs from `entry` in any byte

The file is plain safetensors (``safetensors.safe_open`` reads it): an 8-byte header length, a JSON
header, then the tensors' bytes back to back, laid out by element size (largest first) so that each
tensor starts aligned to its dtype. Writing goes straight from each tensor's own memory (no copy);
reading goes into freshly allocated tensors with plain ``readinto`` calls, so nothing stays mapped
after a load (``safe_open().get_tensor`` returns tensors backed by an ``mmap`` of the file: a resumed
run would keep the checkpoint's disk space allocated after it is deleted, and its pages in the page
cache). The CRC32 (``zlib``, ~0.46 s/GB on one core here) runs on a helper thread, one chunk behind the
write or read of the next, so it costs little more than the I/O where the disk is the bottleneck.

Errors name the file and say what is wrong with it (:class:`~megatrain_lightning.errors.CheckpointError`);
the caller adds what to do.
"""

from __future__ import annotations

import json
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

CHUNK = 8 * 2**20  # bytes per write/read call and CRC step
_INLINE = 2**20  # smaller chunks: CRC'd on the calling thread (a hand-off would cost more)
_MAX_HEADER = 100 * 2**20  # safetensors' own limit
# torch dtype <-> safetensors' names
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Crc32:
    """CRC32 of a byte stream, each chunk added on a helper thread while the caller moves the next one
    (``zlib.crc32`` releases the GIL). Buffer lifetime: a chunk passed to :meth:`update` must stay
    valid and unchanged until the next :meth:`update` or :meth:`hexdigest` returns (the caller's
    tensors and buffers outlive both)."""

    def __init__(self) -> None:
        self.value = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="crc32")
        self._pending: Future[None] | None = None

    def _add(self, chunk: memoryview | bytes) -> None:
        self.value = zlib.crc32(chunk, self.value)

    def update(self, chunk: memoryview | bytes) -> None:
        if self._pending is not None:
            self._pending.result()  # sync point: at most one chunk in flight, in stream order
            self._pending = None
        if len(chunk) < _INLINE:
            self._add(chunk)
        else:
            self._pending = self._pool.submit(self._add, chunk)

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        return f"{self.value:08x}"

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Crc32:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, as a writable buffer over its own memory (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def write_shard(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """Write contiguous host tensors as one safetensors file; returns its index entry: byte size,
    CRC32 of the whole file, and per tensor dtype, shape, byte size and data offsets."""
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())  # stable: keeps the given order within a size
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    entries: dict[str, Any] = {}
    pos = 0
    for key in order:
        t = tensors[key]
        assert t.device.type == "cpu" and t.is_contiguous(), f"{key}: expected a contiguous host tensor"
        n = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        entries[key] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "bytes": n, "offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # the data starts 8-byte aligned
    with open(path, "wb", buffering=0) as f, Crc32() as crc:
        prefix = len(head).to_bytes(8, "little") + head
        crc.update(prefix)
        f.write(prefix)
        for key in order:
            data = byte_view(tensors[key])  # the tensor's own memory: alive until this function returns
            for i in range(0, len(data), CHUNK):
                chunk = data[i : i + CHUNK]
                crc.update(chunk)  # hashed on the helper thread while this thread writes it
                _write_all(f, chunk)
        digest = crc.hexdigest()
    return {"bytes": len(prefix) + pos, "crc32": digest, "tensors": entries}


def _write_all(f: Any, chunk: memoryview) -> None:
    done = 0
    while done < len(chunk):
        done += f.write(chunk[done:])


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def read_shard(path: Path, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Read a shard written by :func:`write_shard` into freshly allocated host tensors (no ``mmap``),
    checking it against its index ``entry`` as the bytes stream: the file size, the header (every
    tensor's dtype, shape and offsets) and the CRC32 of the whole file. Raises CheckpointError."""
    size = _size(path)
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "longer than written"
        raise CheckpointError(f"{path}: {size} bytes where {entry['bytes']} were written ({what})")
    out: dict[str, torch.Tensor] = {}
    with _open(path) as f, Crc32() as crc:
        header, prefix = _read_header(f, path, size)
        crc.update(prefix)
        _check_header(header, entry["tensors"], path)
        for key, spec in sorted(entry["tensors"].items(), key=lambda kv: kv[1]["offsets"][0]):
            t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))  # owned memory
            data = byte_view(t)
            for i in range(0, len(data), CHUNK):
                chunk = data[i : i + CHUNK]
                _read_into(f, chunk, path)
                crc.update(chunk)  # hashed on the helper thread while this thread reads the next
            out[key] = t
        if f.read(1):
            raise CheckpointError(f"{path}: bytes after the last tensor")
        digest = crc.hexdigest()
    if digest != entry["crc32"]:
        raise CheckpointError(f"{path}: CRC32 {digest} where {entry['crc32']} was written (the file's bytes changed)")
    return out


def verify_shard(path: Path, entry: dict[str, Any]) -> int:
    """The checks of :func:`read_shard` without keeping the tensors: the bytes stream through two
    scratch buffers of ``CHUNK`` bytes (one read while the other is hashed). Returns where the data
    starts in the file."""
    size = _size(path)
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "longer than written"
        raise CheckpointError(f"{path}: {size} bytes where {entry['bytes']} were written ({what})")
    buffers = [memoryview(bytearray(CHUNK)), memoryview(bytearray(CHUNK))]
    with _open(path) as f, Crc32() as crc:
        header, prefix = _read_header(f, path, size)
        crc.update(prefix)
        _check_header(header, entry["tensors"], path)
        left, turn = size - len(prefix), 0
        while left:
            chunk = buffers[turn][: min(CHUNK, left)]  # free: its last hash was waited for by the update before
            _read_into(f, chunk, path)
            crc.update(chunk)
            left, turn = left - len(chunk), 1 - turn
        digest = crc.hexdigest()
    if digest != entry["crc32"]:
        raise CheckpointError(f"{path}: CRC32 {digest} where {entry['crc32']} was written (the file's bytes changed)")
    return len(prefix)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and where its data starts (for files without an index)."""
    size = _size(path)
    with _open(path) as f:
        header, prefix = _read_header(f, path, size)
    return header, len(prefix)


def read_unverified(path: Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file into owned memory, with only the header's consistency
    with the file size checked (format-1 checkpoints carry no checksums)."""
    size = _size(path)
    out: dict[str, torch.Tensor] = {}
    with _open(path) as f:
        header, prefix = _read_header(f, path, size)
        specs = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0])
        pos = 0
        for key, spec in specs:
            begin, end = spec["data_offsets"]
            dtype = _BY_NAME.get(spec["dtype"])
            if dtype is None or begin != pos or len(prefix) + end > size:
                raise CheckpointError(f"{path}: header entry {key!r} {spec} does not fit the file")
            t = torch.empty(spec["shape"], dtype=dtype)
            data = byte_view(t)
            if len(data) != end - begin:
                raise CheckpointError(f"{path}: header entry {key!r}: {end - begin} bytes for shape {spec['shape']}")
            for i in range(0, len(data), CHUNK):
                _read_into(f, data[i : i + CHUNK], path)
            out[key] = t
            pos = end
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None


def _open(path: Path) -> Any:
    try:
        return open(path, "rb", buffering=0)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be opened ({err.strerror})") from err


def _read_header(f: Any, path: Path, size: int) -> tuple[dict[str, Any], bytes]:
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header (truncated)")
    head8 = _read_exact(f, 8, path)
    n = int.from_bytes(head8, "little")
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{path}: header length {n} does not fit the {size}-byte file (damaged or truncated)")
    raw = _read_exact(f, n, path)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return header, head8 + raw


def _check_header(header: dict[str, Any], tensors: dict[str, Any], path: Path) -> None:
    """The header must describe exactly the tensors the index lists: a relabelled dtype, a changed shape
    or two swapped entries show up here, before any data is read."""
    keys = set(header) - {"__metadata__"}
    if keys != set(tensors):
        missing, extra = sorted(set(tensors) - keys), sorted(keys - set(tensors))
        raise CheckpointError(f"{path}: the header's tensors differ from the index (missing {missing[:3]}, unexpected {extra[:3]})")
    for key, spec in tensors.items():
        got = header[key]
        want = {"dtype": DTYPES[getattr(torch, spec["dtype"])], "shape": spec["shape"], "data_offsets": spec["offsets"]}
        if not isinstance(got, dict) or {k: got.get(k) for k in want} != want:
            raise CheckpointError(f"{path}: header entry {key!r} is {got}, the index says {want}")


def _read_exact(f: Any, n: int, path: Path) -> bytes:
    buf = bytearray(n)
    _read_into(f, memoryview(buf), path)
    return bytes(buf)


def _read_into(f: Any, view: memoryview, path: Path) -> None:
    done = 0
    while done < len(view):
        try:
            got = f.readinto(view[done:])
        except OSError as err:
            raise CheckpointError(f"{path}: read failed ({err.strerror})") from err
        if not got:
            raise CheckpointError(f"{path}: ends early (truncated)")
        done += got
