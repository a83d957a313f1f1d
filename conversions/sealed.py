"""A training checkpoint folder counts once its seal is written: one small JSON, written last and atomically, holding
the facts of the save and every file's size and sha256. Sizes make the cheap "did the save finish" check; a resume
reads the bytes again and compares the digests (a flipped bit, a torn copy, a file replaced since) before it trusts
the folder. Pretrain (Megatron), rlhf (TRL) and finetune (DeepSpeed) seal their checkpoints the same way.

A digest proves nothing about who wrote it: whoever can write the step folder could replace the files and their
sha256 together. So a seal also carries an HMAC-SHA256 of its body under a key private to the BATON_HOME
(`$BATON_HOME/seal.key`, 32 random bytes, 0600, created once); a seal whose HMAC does not verify is not trusted.
Workers find the key through BATON_SEAL_KEY (a path; the orchestrator sets it, the key itself never travels).

The HMAC covers the body's meaning (its canonical JSON), so the seal file must also be byte for byte the text `seal`
writes: a seal with a byte moved, added or dropped (whitespace, a duplicated key) is not trusted either.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from conversions import durable, manifest as mf
from conversions.manifest import Format
from conversions.home import home_path
from conversions.refusal import Refused

KEY_ENV = "BATON_SEAL_KEY"
KEY_NAME = "seal.key"
KEY_BYTES = 32
# Where each engine's training checkpoints keep their seal (also what the convert step checks in its input).
MARKERS = {Format.DEEPSPEED_ZERO: "baton_complete.json", Format.MEGATRON_DIST: "baton_state.json"}


class SealKeyError(Refused):
    pass


def key_file() -> Path:
    """The seal key's path: BATON_SEAL_KEY, else BATON_HOME's seal.key."""
    return Path(os.environ.get(KEY_ENV) or home_path() / KEY_NAME).absolute()


def ensure_key(path: Path | None = None) -> Path:
    """Create the key once: 0600 from its first byte, fsynced under a unique tmp name, then linked into place
    (a link never replaces a key another process made first, which would orphan every seal it wrote)."""
    path = Path(path or key_file())
    if os.path.lexists(path):
        return path
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, durable.PRIVATE_FILE)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    durable.fsync_dir(path.parent)
    return path


def read_key(path: Path | None = None) -> bytes:
    """The key's bytes; SealKeyError (naming the file, never its content) unless it is a regular 0600 file of ours."""
    path = Path(path or key_file())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise SealKeyError(f"seal key {path}: cannot be opened ({e.strerror}; a symlink is refused)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise SealKeyError(f"seal key {path}: must be a regular file owned by uid {os.getuid()} with mode 0600 "
                               f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise SealKeyError(f"seal key {path}: must hold {KEY_BYTES} bytes")
    return key


def _mac(body: dict, key: bytes) -> str:
    unsigned = {k: v for k, v in body.items() if k != "hmac"}
    return hmac.new(key, json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def signature_problem(body: dict) -> str | None:
    """Why this seal was not written with this BATON_HOME's key (None when its HMAC verifies)."""
    given = body.get("hmac")
    if not isinstance(given, str):
        return "its seal carries no HMAC (not written by baton with this BATON_HOME's key)"
    if not hmac.compare_digest(given, _mac(body, read_key(ensure_key()))):
        return "its seal's HMAC does not verify with this BATON_HOME's key (written elsewhere, or edited)"
    return None


def _content(folder: Path, marker: str) -> list[Path]:
    """Every file below folder but the seal and its tmp files (`.<marker>.*.tmp`)."""
    return [f for f in sorted(folder.rglob("*")) if f.is_file() and marker not in f.name]


def _text(body: dict) -> str:
    """The seal file's only accepted spelling of body."""
    return json.dumps(body, indent=2) + "\n"


def seal(folder: Path, marker: str, **facts) -> dict:
    """Write folder/marker with facts, sizes and sha256 of what is on disk now (call after the files are fsynced)."""
    files = _content(folder, marker)
    names = [f.relative_to(folder).as_posix() for f in files]
    body = {**facts, "files": {n: f.stat().st_size for n, f in zip(names, files)},
            "sha256": dict(zip(names, mf.sha256_files(files)))}
    body["hmac"] = _mac(body, read_key(ensure_key()))
    durable.write_text(folder / marker, _text(body))
    return body


def read(folder: Path, marker: str) -> dict | None:
    """The seal's body; None when it is missing, unreadable or not a JSON object."""
    try:
        body = json.loads((folder / marker).read_text())
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, or nested deeper than the parser goes
        return None
    return body if isinstance(body, dict) else None


def is_sealed(folder: Path, marker: str) -> bool:
    """The save finished: the seal exists and every file it lists is there with its size (no content read)."""
    body = read(folder, marker)
    sizes = (body or {}).get("files") or {}
    return bool(sizes) and all((folder / n).is_file() and (folder / n).stat().st_size == s for n, s in sizes.items())


def problem(folder: Path, marker: str) -> str | None:
    """Why this folder's contents are not what its seal recorded (None when every file's sha256 matches)."""
    body = read(folder, marker)
    if body is None:
        return f"no {marker} (the save did not finish)"
    untrusted = signature_problem(body)
    if untrusted:
        return untrusted  # before any byte of the files is read: nothing in this folder is trusted
    if (folder / marker).read_bytes() != _text(body).encode():
        return f"{marker} is not the text baton wrote (its meaning verifies, its bytes were edited)"
    hashes = body.get("sha256")
    if not hashes:
        return "no sha256 recorded at save time"
    missing = [n for n in hashes if not (folder / n).is_file()]
    if missing:
        return f"{missing[0]} is missing"
    names = list(hashes)
    actual = mf.sha256_files([folder / n for n in names], reuse=False)  # read the bytes, whatever the stat says
    changed = [n for n, h in zip(names, actual) if h != hashes[n]]
    return f"{changed[0]} differs from the sha256 recorded at save time" if changed else None
