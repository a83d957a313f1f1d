"""`$BATON_HOME/stack.env`: the client settings `make up` writes (where the local Prefect and MLflow servers listen)
and `baton` reads. BATON_HOME defaults to ./.baton, so the file may come from whatever folder baton is started in:
it is accepted only as what `make up` writes (these keys, loopback URLs, a plain pool name) in a file the user owns
with mode 0600. Anything else (a PYTHONPATH copied into every engine's environment, a remote tracking server) is
refused naming the file, line and key, never echoing a value.
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from urllib.parse import urlsplit

from conversions import durable
from conversions.refusal import Refused

URL_KEYS = ("PREFECT_API_URL", "PREFECT_UI_URL", "MLFLOW_TRACKING_URI")
KEYS = (*URL_KEYS, "BATON_WORK_POOL")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
HEADER = "# written by `make up`; removed by `make down`\n"


class StackEnvError(Refused):
    pass


def write(path: Path, env: dict[str, str]) -> Path:
    """What `make up` writes: the keys above only, 0600 from the start, atomically."""
    unknown = sorted(set(env) - set(KEYS))
    if unknown:
        raise StackEnvError(f"{path}: {', '.join(unknown)} not among the keys stack.env holds ({', '.join(KEYS)})")
    return durable.write_text(Path(path), HEADER + "".join(f"{k}={v}\n" for k, v in env.items()), mode=0o600)


def _owner_problem(path: Path) -> str | None:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a symlink is refused)"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):o}; `make up` writes it 0600 (chmod 600 it, or run `make up` again)"
    return None


def _value_problem(key: str, value: str) -> str | None:
    if key not in KEYS:
        return f"{key} is not a key `make up` writes ({', '.join(KEYS)})"
    if key == "BATON_WORK_POOL":
        return None if POOL_NAME.match(value) else f"{key} is not a plain work pool name"
    try:
        url = urlsplit(value)
        host = url.hostname
    except ValueError:
        return f"{key} is not a URL"
    if url.scheme not in ("http", "https") or host not in LOOPBACK:
        return f"{key} is not an http(s) URL on this machine's loopback ({', '.join(LOOPBACK)})"
    return None


def read(path: Path) -> dict[str, str]:
    """The settings of a stack.env, or StackEnvError naming the file, line and key of the first problem."""
    path = Path(path)
    problem = _owner_problem(path)
    if problem:
        raise StackEnvError(f"{path}: {problem}; not used")
    out = {}
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not ENV_NAME.fullmatch(key):
            raise StackEnvError(f"{path}:{n}: not a KEY=VALUE line; not used")
        problem = _value_problem(key, value.strip())
        if problem:
            raise StackEnvError(f"{path}:{n}: {problem}; not used")
        out[key] = value.strip()
    return out
