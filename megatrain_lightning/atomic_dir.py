"""Publishing a directory atomically: checkpoints and Hugging Face exports are written into a temporary
sibling, flushed, then renamed into place, so an interruption never loses the last good one."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_tree(directory: Path) -> None:
    """Flush the files and the directory entry before the rename publishes them (so a power loss cannot
    leave a renamed but empty directory); costs waiting for the disk to catch up."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``. An existing ``out`` (directory, file or link) is moved aside first and
    deleted after (POSIX has no portable atomic swap of two directories): if the process dies between the
    two renames, the previous version is in the ``.NAME.old-*`` sibling."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
