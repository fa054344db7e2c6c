"""A pytest plugin that records what nbval saw in each notebook cell, for ``kvcourse.grading.gradebook``.

nbval runs a notebook cell by cell in one kernel and, for check cells, compares the outputs with the
stored ones. This plugin keeps, for every cell, whether its test passed, the text it printed, the
error it raised, how long it took and how it ended (``status``: ``ok``, ``error``, ``timeout``, ``died`` when the kernel
died while the cell ran, ``dead`` when it was dead before the cell started), and rewrites them as
JSON to the file named by ``KVCOURSE_NBVAL_REPORT`` after every cell, so a run that is cut off still
leaves what it did. Loaded with ``pytest -p kvcourse.grading.nbval_report``.

It also makes nbval notice a dead kernel at once. nbval waits for a cell's reply for the whole cell
timeout, even when the kernel has exited (``os._exit`` in a cell cost ten minutes); here the wait
polls every ``POLL_SECONDS`` and raises ``KernelDied`` as soon as the kernel process is gone. This
replaces nbval's ``RunningKernel.await_reply`` (nbval 0.11.0), keeping its behaviour otherwise.

Left out on purpose: images and rich outputs (check cells print text only).
"""

from __future__ import annotations

import json
import os
import time
from queue import Empty

import pytest
from nbval.kernel import RunningKernel

REPORT_ENV = "KVCOURSE_NBVAL_REPORT"
POLL_SECONDS = 0.5
_results: list[dict] = []


class KernelDied(RuntimeError):
    """The kernel process exited while a cell was running."""


def await_reply(self, msg_id, timeout=None):
    """nbval's wait for a cell's reply on the shell channel, which also watches the kernel process."""
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    while True:
        try:
            msg = self.get_message(stream="shell", timeout=POLL_SECONDS)
        except Empty:
            if not self.is_alive():
                raise KernelDied("the kernel died while the cell ran") from None
            if deadline is not None and time.monotonic() > deadline:
                raise
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            if msg["content"]["status"] == "aborted":
                raise RuntimeError("Kernel aborted execution request")
            return


RunningKernel.await_reply = await_reply


def status_of(report, call) -> str:
    """How a cell ended, from its pytest report and the exception nbval raised (if any)."""
    if report.passed:
        return "ok"
    text = str(call.excinfo.value) if call.excinfo else ""
    if call.excinfo and call.excinfo.errisinstance(KernelDied):
        return "died"
    if "Kernel dead on test start" in text:
        return "dead"
    if "Timeout" in text:
        return "timeout"
    return "error"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when != "call" or not hasattr(item, "cell_num"):
        return
    outputs = getattr(item, "test_outputs", None) or []
    error = next((f"{o['ename']}: {o['evalue']}" for o in outputs if o.get("output_type") == "error"), None)
    status = status_of(report, call)
    if error is None and status == "timeout":
        error = "timeout: the cell ran out of time"
    _results.append(
        {
            "cell": item.cell_num,  # index among the notebook's code cells
            "passed": report.passed,
            "status": status,
            "text": "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream"),
            "error": error,
            "seconds": round(call.duration, 2),
        }
    )
    path = os.environ.get(REPORT_ENV)
    if path:  # after every cell: a run cut off later keeps what it did
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(_results, f)
        os.replace(path + ".part", path)
