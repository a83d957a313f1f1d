"""`$BATON_HOME/stack.env`: the client settings `make up` writes (where the local Prefect and MLflow servers listen,
and the credentials they ask for) and `baton` reads. BATON_HOME defaults to ./.baton, so the file may come from
whatever folder baton is started in: it is accepted only as what `make up` writes (these keys, loopback URLs, a plain
pool name, credentials without spaces) in a file the user owns with mode 0600. Anything else (a PYTHONPATH copied into
every engine's environment, a remote tracking server) is refused naming the file, line and key, never echoing a value.

The same format and rules hold for `$BATON_HOME/stack/secrets.env`, where `make up` keeps the credentials it generated
once (CREDENTIAL_KEYS only): stack.env, removed by `make down`, is written again from it by each `make up`.
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
# Prefect's client auth string ("user:password", sent as HTTP basic auth) and the MLflow basic-auth user
CREDENTIAL_KEYS = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
KEYS = (*URL_KEYS, "BATON_WORK_POOL", *CREDENTIAL_KEYS)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CREDENTIAL = re.compile(r"^[A-Za-z0-9_.:~-]{1,256}$")
HEADER = "# written by `make up`; removed by `make down`\n"


class StackEnvError(Refused):
    pass


def write(path: Path, env: dict[str, str], header: str = HEADER) -> Path:
    """What `make up` writes: the keys above only, each value as read() accepts it, 0600 from the start, atomically."""
    unknown = sorted(set(env) - set(KEYS))
    if unknown:
        raise StackEnvError(f"{path}: {', '.join(unknown)} not among the keys stack.env holds ({', '.join(KEYS)})")
    bad = [key for key, value in env.items() if _value_problem(key, value)]
    if bad:
        raise StackEnvError(f"{path}: {', '.join(bad)}: {_value_problem(bad[0], env[bad[0]])}")
    return durable.write_text(Path(path), header + "".join(f"{k}={v}\n" for k, v in env.items()), mode=0o600)


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
    if key in CREDENTIAL_KEYS:
        return None if CREDENTIAL.match(value) else f"{key} is not a credential as `make up` generates it"
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
