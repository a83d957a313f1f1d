"""What never leaves baton in clear: values of keys that look like secrets, and every value of an engine runtime's
`env` (tokens and passwords live there). Applied to MLflow params and artifacts, the run folder's config copy, and
Prefect parameters."""
from __future__ import annotations

import re

from tasks.problems import ConfigProblem

REDACTED = "***redacted***"
# whole words of a key (HF_TOKEN, db_password, apiKey): `tokenizer` and `max_tokens` are not secrets
SECRET_WORDS = {"pass", "passwd", "password", "pwd", "secret", "token", "apikey", "credential", "credentials", "auth",
                "authorization", "privatekey"}
SECRET_SUFFIXES = ("password", "secret", "token")  # accesstoken, clientsecret


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key))
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """A key whose value is a secret (a `*_file` / `*_path` key names where one is kept: not itself secret)."""
    words = _words(key)
    if not words or words[-1] in ("file", "path"):
        return False
    pairs = {a + b for a, b in zip(words, words[1:])}
    return bool((set(words) | pairs) & SECRET_WORDS) or any(w.endswith(SECRET_SUFFIXES) for w in words)


def redact(obj, path: tuple = ()):
    """A copy of obj with secret values replaced (dicts and lists walked; `runtimes.<name>.env` values all go)."""
    if isinstance(obj, dict):
        env_block = len(path) >= 2 and path[-1] == "env" and "runtimes" in path
        return {k: (REDACTED if (env_block or is_secret_key(k)) and v not in (None, "", {}, [])
                    and not isinstance(v, (dict, list)) else redact(v, path + (k,)))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, path) for v in obj)
    return obj


def command_line_errors(cfg) -> list[ConfigProblem]:
    """Config lists that become command-line arguments (visible to every user in `ps`, kept in shell histories and
    job records) must not carry a secret: `--hf-token X`, `--api-key=X`, `logger.wandb.api_key=X`."""
    lists = {f"serve.engine_args.{k}": v for k, v in cfg.serve.engine_args.items()}
    lists["rlhf.nemo_rl.overrides"] = cfg.rlhf.nemo_rl.overrides
    for name, rt in cfg.runtimes.items():
        lists[f"runtimes.{name}.srun_args"], lists[f"runtimes.{name}.sbatch_args"] = rt.srun_args, rt.sbatch_args
    errors = []
    for key, args in lists.items():
        for i, arg in enumerate(args):
            flag = str(arg).split("=", 1)[0].lstrip("-")
            if flag and is_secret_key(flag):
                errors.append(ConfigProblem(f"{key}[{i}]", f"{key}[{i}]: {flag} would put a secret on a command line "
                                            "(visible in `ps`); set it in runtimes.<runtime>.env instead"))
    return errors
