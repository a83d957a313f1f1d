"""The one base of expected failures: something a user handed us (a config, a data row, a checkpoint, a model) was
refused, and the message says what and where in one line. A run shows that line and the log's path; tracebacks are for
bugs in baton."""
from __future__ import annotations


class Refused(ValueError):
    pass
