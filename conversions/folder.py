"""What a checkpoint folder may hold: directories and regular files, nothing else. A symlink (even one pointing inside),
a device, a FIFO or a socket makes the folder unsafe to read or copy: a link can lead any reader to a file outside
(a 0600 secret copied into the output), a FIFO blocks a reader forever, a device reads without end. Copies baton
makes of checkpoint files open the source without following links and copy only a regular file.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from .refusal import Refused


class UnsafeEntryError(Refused):
    pass


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def unsafe_entries(root: Path) -> list[str]:
    """'<path relative to root>: <what it is>' for every entry below root that is neither a directory nor a regular
    file (os.walk lists a symlinked directory without entering it, so nothing outside root is visited)."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
                continue
            found.append(f"{path.relative_to(root).as_posix()}: {_describe(path, mode)}")
    return sorted(found)


def _describe(path: Path, mode: int) -> str:
    if not stat.S_ISLNK(mode):
        return _kind(mode)
    target = os.readlink(path)
    where = "outside the folder" if _escapes(path, target) else "inside the folder"
    return f"a symlink to {target} ({where}); checkpoint folders hold regular files only"


def _escapes(link: Path, target: str) -> bool:
    resolved = (link.parent / target).resolve()
    root_parts = link.parent.resolve().parts
    return os.path.isabs(target) or resolved.parts[:len(root_parts)] != root_parts


def refuse_unsafe(root: Path) -> None:
    """UnsafeEntryError naming every entry below root that is not a directory or a regular file."""
    found = unsafe_entries(root)
    if found:
        raise UnsafeEntryError(f"{root}: {'; '.join(found[:5])}" + (f" (+{len(found) - 5} more)" if len(found) > 5 else ""))


def copy_file(src: Path, dst: Path) -> Path:
    """Copy one regular file (content and mode bits) without following a link at src: a symlink, FIFO or device there
    is refused with UnsafeEntryError (opened with O_NOFOLLOW|O_NONBLOCK, checked on the open descriptor, so a swap
    between check and copy cannot redirect it)."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if os.path.islink(src):
            raise UnsafeEntryError(f"{src}: a symlink; checkpoint folders hold regular files only") from e
        raise
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeEntryError(f"{src}: {_kind(mode)}; checkpoint folders hold regular files only")
        with open(dst, "wb") as out:
            shutil.copyfileobj(f, out)
        os.chmod(dst, stat.S_IMODE(mode))
    return Path(dst)


def copy_tree(src: Path, dst: Path, ignore=None) -> Path:
    """shutil.copytree of a folder of directories and regular files only (refused whole, before anything is copied,
    when it holds anything else; each file copied through copy_file)."""
    refuse_unsafe(src)
    shutil.copytree(src, dst, ignore=ignore, copy_function=copy_file, dirs_exist_ok=True)
    return Path(dst)
