"""A pytest plugin for the GPU runbook: each failure's report is appended to the file named by
``$JAXPREP_FAILURE_LOG`` the moment it happens, so a suite cut off by the runbook's budget (killed, no
summary printed) still leaves which tests failed and why.

    JAXPREP_FAILURE_LOG=failures.md python -m pytest -p pytest_failure_log ...   # benchmarks/ on PYTHONPATH

Under pytest-xdist only the controller writes (the workers' reports reach it too)."""

from __future__ import annotations

import os

ENV = "JAXPREP_FAILURE_LOG"
MAX_CHARS = 6000
"""Of each failure's report: its end, where the assertion or the exception is."""
HEADING = "## FAILED "
_config = None


def pytest_configure(config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(ENV)
    if not path or not report.failed or hasattr(_config, "workerinput"):
        return
    text = report.longreprtext
    if len(text) > MAX_CHARS:
        text = "...\n" + text[-MAX_CHARS:]
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{HEADING}{report.nodeid} ({report.when})\n\n```\n{text}\n```\n\n")


def failed_tests(path: str) -> list[str]:
    """The test ids written to a failure log, in order, once each."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as log:
        ids = [line[len(HEADING):].rsplit(" (", 1)[0] for line in log if line.startswith(HEADING)]
    return list(dict.fromkeys(ids))
