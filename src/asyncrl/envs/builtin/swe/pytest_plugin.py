"""pytest plugin loaded inside the `swe` sandbox when a task is graded (stdlib only; not imported by asyncrl).

The grader binds this file read-only as `asyncrl_swe_report.py`, puts it on PYTHONPATH and sets
`PYTEST_ADDOPTS=-p asyncrl_swe_report`, with `ASYNCRL_SWE_NONCE` and `ASYNCRL_SWE_REPORT` (a file
path) in the environment. After each test's teardown it appends `<nonce> <outcome> <node id>` to
that file: outcome is passed, failed (in setup, call or teardown), skipped, xfailed or xpassed.
The nonce keeps output printed by code under test from counting; both variables are removed from
the environment before any test runs.
"""

import os

_NONCE = os.environ.pop("ASYNCRL_SWE_NONCE", "")
_REPORT = os.environ.pop("ASYNCRL_SWE_REPORT", "")
_outcomes: dict = {}


def _outcome(report) -> str:
    if report.failed:
        return "failed"
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    return "skipped" if report.skipped else "passed"


def pytest_runtest_logreport(report) -> None:
    outcome = _outcome(report)
    seen = _outcomes.get(report.nodeid)
    if seen != "failed" and (report.when == "call" or outcome in ("failed", "skipped") or seen is None):
        _outcomes[report.nodeid] = outcome
    if report.when == "teardown" and _NONCE and _REPORT:
        with open(_REPORT, "a") as f:
            f.write(f"{_NONCE} {_outcomes.pop(report.nodeid, outcome)} {report.nodeid}\n")
