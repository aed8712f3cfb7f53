"""Publishing and removing a checkpoint (or an export) atomically, and tidying up after a hard kill.

A checkpoint is written into a hidden temporary sibling, flushed, then published under its name in one
step, so a reader sees either the previous version or the new one, never a part of one:

    tmp = sibling(out, "tmp"); ...write into tmp...; fsync_tree(tmp); replace(tmp, out)
    remove(out)                                            # the name goes first, then the files
    tidy(out.parent)                                       # after a kill: leftovers removed, `out` restored

Hidden siblings are named ``.NAME.KIND-PID-RANDOM``, KIND one of

- ``tmp``: a version being written (or, after a swap, the previous one on its way out);
- ``old``: the previous version, moved aside where the file system cannot swap two names (see
  :func:`replace`);
- ``del``: a checkpoint being removed (renamed first, so a kill mid-delete leaves no half-deleted
  checkpoint under its own name).

Lightning's checkpoint lookup never picks them (``ModelCheckpoint`` matches ``last*.ckpt``: their suffix
is ``.KIND-...``), and :func:`tidy` removes them once their writer is gone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import platform
import re
import shutil
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

KINDS = ("tmp", "old", "del")
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?:(?P<pid>\d+)-)?[0-9A-Za-z_]+$")
# Hidden siblings this process is writing or deleting right now: tidy() leaves them alone (a save run
# in a background thread, e.g. by Lightning's AsyncCheckpointIO, may be in flight).
_IN_FLIGHT: set[str] = set()


def fsync_tree(directory: Path) -> None:
    """Flush the files and the directory entry before the rename publishes them (so a power loss cannot
    leave a renamed but empty directory); costs waiting for the disk to catch up."""
    for path in directory.iterdir():
        if path.is_file():
            fsync_file(path)
    fsync_dir(directory)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sibling(out: Path, kind: str) -> Path:
    """A fresh hidden sibling name of ``out`` (nothing is created), marked in flight until
    :func:`release`."""
    assert kind in KINDS, kind
    path = out.with_name(f".{out.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    _IN_FLIGHT.add(str(path))
    return path


def release(path: Path) -> None:
    _IN_FLIGHT.discard(str(path))


def replace(new: Path, out: Path) -> None:
    """Publish ``new`` (a file or directory) under ``out``'s name, which is never absent meanwhile.

    Where ``out`` is missing, or both are files (or links): one ``rename``. Otherwise the two names are
    swapped in one step (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs, btrfs, tmpfs, overlayfs) and
    the previous version, now under ``new``'s hidden name, is deleted. Where the file system cannot swap
    (EINVAL, e.g. NFS; or no ``renameat2``), ``out`` is moved aside to ``.NAME.old-*`` first: a kill
    between that rename and the next leaves ``out`` missing, and :func:`tidy` (at the next start) renames
    the old version back.
    """
    parent = out.parent
    try:
        if not os.path.lexists(out) or (not _is_real_dir(new) and not _is_real_dir(out)):
            os.replace(new, out)  # atomic for a file over a file or link, or into a free name
            fsync_dir(parent)
            return
        if _exchange(new, out):  # out: the new version; new: the previous one
            fsync_dir(parent)
            _delete(new)
            return
        old = sibling(out, "old")
        try:
            _move(out, old)
            try:
                _move(new, out)
            except BaseException:
                _move(old, out)
                raise
            fsync_dir(parent)
            _delete(old)
        finally:
            release(old)
    finally:
        release(new)


def _move(src: Path, dst: Path) -> None:
    """One rename of the two-rename replace; tests kill a process between two of them here."""
    os.replace(src, dst)


def remove(path: Path) -> None:
    """Remove a file, link or directory; a directory is first renamed to a hidden ``.NAME.del-*``
    sibling (one atomic step: its name is gone) and only then deleted file by file."""
    if os.path.islink(path) or path.is_file():
        path.unlink()
        return
    if not path.is_dir():
        return
    doomed = sibling(path, "del")
    try:
        os.rename(path, doomed)
        fsync_dir(path.parent)
        _delete(doomed)
    finally:
        release(doomed)


def tidy(directory: Path) -> list[str]:
    """Clean up what a hard kill left in ``directory``: hidden ``tmp``/``old``/``del`` siblings whose
    writer (the pid in the name) is no longer alive are deleted, except that an ``old`` one whose
    checkpoint name is missing (killed between the two renames of :func:`replace`) is renamed back to
    it first. Returns one line per action, for the log. Nothing in flight in this process, nor anything
    of a live process on this machine, is touched."""
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    found: list[tuple[str, str, Path]] = []
    for entry in entries:
        m = _SIBLING.match(entry)
        path = directory / entry
        if m is None or str(path) in _IN_FLIGHT or _alive(m["pid"]):
            continue
        found.append((m["name"], m["kind"], path))
    actions: list[str] = []
    # old versions first: one may have to take its name back before the rest is deleted
    olds = sorted((p for _, kind, p in found if kind == "old"), key=_mtime, reverse=True)
    for path in olds:
        name = _SIBLING.match(path.name)["name"]  # type: ignore[index]
        target = directory / name
        if not os.path.lexists(target):
            os.rename(path, target)
            fsync_dir(directory)
            actions.append(f"restored {target} from {path.name} (a replace was interrupted)")
        else:
            _delete(path)
            actions.append(f"deleted {path.name}")
    for _, kind, path in found:
        if kind != "old":
            _delete(path)
            actions.append(f"deleted {path.name}")
    for line in actions:
        log.warning("checkpoint directory %s: %s", directory, line)
    return actions


def discard(path: Path) -> None:
    """Delete a hidden sibling (a failed save's ``tmp``), whatever it holds; nothing if it is gone."""
    _delete(path)


def _delete(path: Path) -> None:
    if _is_real_dir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def _is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except FileNotFoundError:
        return 0.0


def _alive(pid: str | None) -> bool:
    """Whether the writer named by ``pid`` may still be working (another live process on this
    machine); this process's own leftovers (not in flight) count as dead."""
    if pid is None or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


# ---------------------------------------------------------------------------------------------
# renameat2(RENAME_EXCHANGE)
# ---------------------------------------------------------------------------------------------
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYSCALL_NR = {"x86_64": 316, "aarch64": 276}  # renameat2, for a libc without the wrapper


def _load_renameat2():  # type: ignore[no-untyped-def]
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return lambda a, b: fn(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
    nr = _SYSCALL_NR.get(platform.machine())
    if nr is None:
        return None
    syscall = libc.syscall
    return lambda a, b: syscall(nr, _AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)


_renameat2 = _load_renameat2()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing names in one step; False where this platform or file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, f"swapping {a} and {b}: {os.strerror(err)}")
