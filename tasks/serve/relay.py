"""Run an engine and copy its output into a log file with every secret replaced by ***: what a detached server
(keep_alive) writes, since no baton process stays behind to filter its log. The secrets come in BATON_REDACT
(newline-separated), never on the command line, and are removed from the engine's own environment.

    python relay.py LOG -- ENGINE_CMD...
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def main() -> int:
    log_path, cmd = sys.argv[1], sys.argv[3:]
    secrets = [s for s in os.environ.pop("BATON_REDACT", "").split("\n") if s]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "w", buffering=1) as log, proc.stdout:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            for secret in secrets:
                line = line.replace(secret, "***")
            log.write(line)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
