"""A pytest plugin that `asyncrl swe-tasks` loads into the repository's test run (never imported by asyncrl).

The generator copies this file to a directory of its own, puts that on PYTHONPATH and runs the
tests with `-p asyncrl_swe_probe`. At the end of the session it writes one JSON file
($ASYNCRL_SWE_PROBE_OUT):

    {"outcomes": {test id: "passed" | "failed" | "skipped"},
     "failures": {test id: {"when": "call", "error": "AssertionError: assert 2 == 3",
                            "frames": [[path, line, function], ...]}},
     "called":   {test id: [[path, first line], ...]}}

`called` lists the Python functions (by their code objects) each test ran, setup and teardown
included, under the directory $ASYNCRL_SWE_TRACE_ROOT; it is written only when that is set.
A profile hook (calls and returns only) is much cheaper than line tracing and is all that is needed
to know which functions a test covers.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest

_OUT = os.environ["ASYNCRL_SWE_PROBE_OUT"]
_ROOT = os.environ.get("ASYNCRL_SWE_TRACE_ROOT")
_outcomes: dict[str, str] = {}
_failures: dict[str, dict] = {}
_called: dict[str, set] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _ROOT is None:
        return (yield)
    codes: set = set()

    def profile(frame, event, arg):
        if event == "call":
            codes.add(frame.f_code)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        return (yield)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        _called[item.nodeid] = codes


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and call.excinfo is not None and item.nodeid not in _failures:
        frames = [[str(e.path), e.lineno + 1, e.name] for e in call.excinfo.traceback]
        error = call.excinfo.exconly(tryshort=True)
        _failures[item.nodeid] = {"when": call.when, "error": error, "frames": frames}
    return report


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and _outcomes.get(report.nodeid) != "failed":
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.nodeid not in _outcomes:
        _outcomes[report.nodeid] = "passed"


def _under_root(codes: set, root: str, paths: dict[str, str | None]) -> list[list]:
    found = set()
    for code in codes:
        if code.co_filename not in paths:
            real = os.path.realpath(code.co_filename)
            paths[code.co_filename] = os.path.relpath(real, root) if real.startswith(root + os.sep) else None
        if paths[code.co_filename] is not None:
            found.add((paths[code.co_filename], code.co_firstlineno))
    return sorted([path, line] for path, line in found)


def pytest_sessionfinish(session, exitstatus):
    called = {}
    if _ROOT is not None:
        root, paths = os.path.realpath(_ROOT), {}
        called = {test_id: _under_root(codes, root, paths) for test_id, codes in _called.items()}
    with open(_OUT, "w") as f:
        json.dump({"outcomes": _outcomes, "failures": _failures, "called": called}, f)
