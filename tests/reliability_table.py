"""pytest plugin (registered by conftest, so `make reliability` and `make test` both print it): one row per injected
fault of the tests marked `reliability` (the `fault` property a test records, else its name): times injected,
survived (the test's assertions on the outcome held), data lost (injections whose outcome did not hold: counted as
lost, since those tests assert that nothing was lost or exposed)."""
from __future__ import annotations

import collections

_rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def pytest_runtest_logreport(report):
    if "reliability" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        name = report.nodeid.split("::")[-1].split("@")[0]  # xdist's loadgroup appends @group
        fault = dict(report.user_properties).get("fault") or name.removeprefix("test_")
        row = _rows[fault]
        if report.skipped:
            row["skipped"] += 1
            return
        row["injected"] += 1
        row["survived" if report.passed else "lost"] += 1


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    w = max(len(f) for f in _rows) + 2
    tr = terminalreporter
    tr.write_line("")
    tr.write_line(f"{'fault':<{w}}{'injected':>9}{'survived':>10}{'data lost':>11}{'skipped':>9}")
    for fault, row in sorted(_rows.items()):
        tr.write_line(f"{fault:<{w}}{row['injected']:>9}{row['survived']:>10}{row['lost']:>11}{row['skipped']:>9}")
    total = sum((r for r in _rows.values()), collections.Counter())
    tr.write_line(f"{'total':<{w}}{total['injected']:>9}{total['survived']:>10}{total['lost']:>11}"
                  f"{total['skipped']:>9}")
