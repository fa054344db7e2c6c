"""A pytest plugin that records what nbval saw in each notebook cell, for ``kvcourse.grade``.

nbval runs a notebook cell by cell in one kernel and, for check cells, compares the outputs with the
stored ones. This plugin keeps, for every cell, whether its test passed, the text it printed and the
error it raised, and writes them as JSON to the file named by ``KVCOURSE_NBVAL_REPORT`` when the
session ends. Loaded with ``pytest -p kvcourse.nbval_report``.

Left out on purpose: images and rich outputs (check cells print text only).
"""

from __future__ import annotations

import json
import os

import pytest

REPORT_ENV = "KVCOURSE_NBVAL_REPORT"
_results: list[dict] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when != "call" or not hasattr(item, "cell_num"):
        return
    outputs = item.test_outputs or []
    error = next((f"{o['ename']}: {o['evalue']}" for o in outputs if o.get("output_type") == "error"), None)
    if error is None and report.failed and "Timeout" in str(call.excinfo.value if call.excinfo else ""):
        error = "timeout: the cell ran out of time"
    _results.append(
        {
            "cell": item.cell_num,  # index among the notebook's code cells
            "passed": report.passed,
            "text": "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream"),
            "error": error,
        }
    )


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_results, f)
