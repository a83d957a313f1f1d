"""Writes that others rely on: a reader sees the old content or the whole new one, and after a crash (power loss
included) the new content is on disk once the call has returned.

write_bytes/write_text/write_json: a uniquely named tmp file beside the target (two writers never share one),
fsync, rename over the target, fsync the folder so the rename itself is durable. publish_dir does the same for a
whole folder built under a `.partial` name: every file fsynced, then one rename.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

PRIVATE_FILE = 0o600


class DiskFullError(OSError):
    """ENOSPC while writing: names the disk, and leaves the previous content in place."""


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full(path: Path, err: OSError) -> DiskFullError:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        free = -1
    return DiskFullError(errno.ENOSPC, f"no space left on the disk holding {path} ({free} bytes free); the previous "
                                       "content was left in place")


def mount_point(path: Path) -> Path:
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def describe_disk(path: Path) -> str:
    """'the disk mounted at /x (N MB free of M MB)', for messages about where space ran out."""
    existing = Path(path).resolve()
    while not existing.exists():
        existing = existing.parent
    usage = shutil.disk_usage(existing)
    return (f"the disk mounted at {mount_point(existing)} ({usage.free / 1e6:.1f} MB free of "
            f"{usage.total / 1e6:.1f} MB)")


def free_space_problem(path: Path, needed: int) -> str | None:
    """A message when the disk holding path has less than `needed` bytes free, else None."""
    existing = Path(path).resolve()
    while not existing.exists():
        existing = existing.parent
    if shutil.disk_usage(existing).free >= needed:
        return None
    return f"not enough free space for {path}: needs about {needed / 1e6:.1f} MB on {describe_disk(existing)}"


NEARLY_FULL = 1 << 20  # a writer that dropped errno failed on a disk with less than this free: ENOSPC


def is_disk_full(err: BaseException, path: Path) -> bool:
    """ENOSPC as the errno of an OSError anywhere in err's chain, or (for a writer that drops errno: torch's zip writer
    says only "file write failed", a C++ library raises RuntimeError) the disk holding path has under 1 MiB free right
    after the failure. Never the message text: the disk's own state decides."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    existing = Path(path).resolve()
    while not existing.exists():
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free < NEARLY_FULL
    except OSError:
        return False


@contextmanager
def disk_full_names_the_disk(partial: Path, what: str = "checkpoint"):
    """Around a save into the folder `partial` (an engine's writer, whatever it raises): when the disk ran out of
    space, remove the partial folder (freeing the space; earlier checkpoints beside it stay as they are) and raise
    DiskFullError naming the disk, its free space at the failure and after the clean-up."""
    partial = Path(partial)
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if not is_disk_full(e, partial):
            raise
        at_failure = describe_disk(partial)
        shutil.rmtree(partial, ignore_errors=True)
        after = shutil.disk_usage(mount_point(partial)).free
        raise DiskFullError(errno.ENOSPC, f"No space left on device (ENOSPC) saving {what} {partial}: "
                                          f"{at_failure}; the partial {what} was removed ({after / 1e6:.1f} MB free "
                                          f"now) and earlier ones are untouched; free space on that disk and run "
                                          f"again to resume ({type(e).__name__}: {_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


def write_bytes(path: Path, data: bytes, mode: int | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode if mode is not None else _default_mode(path))
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise (_disk_full(path.parent, e) if e.errno == errno.ENOSPC else e)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _default_mode(path: Path) -> int:
    """Keep an existing file's mode; a new one gets what the umask allows (0600 under a private BATON_HOME)."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask without setting it (os.umask would change it for other threads meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o077


def write_text(path: Path, text: str, mode: int | None = None) -> Path:
    return write_bytes(path, text.encode(), mode)


def write_json(path: Path, obj, mode: int | None = None, **dumps) -> Path:
    dumps.setdefault("indent", 2)
    return write_text(path, json.dumps(obj, **dumps) + "\n", mode)


def sync_tree(root: Path) -> None:
    """fsync every file and folder under root (before it is renamed into place)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def partial_of(final: Path) -> Path:
    return Path(final).with_name(Path(final).name + ".partial")


def publish_dir(partial: Path, final: Path) -> Path:
    """Rename a complete folder into place, durably. Refuses to replace a published folder (they are immutable)."""
    partial, final = Path(partial), Path(final)
    if final.exists():
        raise FileExistsError(f"{final}: already published; a new attempt writes a new folder")
    sync_tree(partial)
    os.rename(partial, final)
    fsync_dir(final.parent)
    return final
