"""The clean child interpreter that ``measure.diagnose_in_child`` starts: it measures the pipeline it is sent
(``measure.diagnose_here``) and sends back progress and the Diagnosis's JSON file."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from multiprocessing.connection import Connection

import cloudpickle

from .._runners.children import exit_without_finalizing
from .measure import diagnose_here


class _RemoteBar:
    """What ``diagnose_here`` uses of a progress bar, sent to the parent's bar."""

    def __init__(self, data: Connection, total: int, unit: str) -> None:
        self._data, self.total, self.n = data, total, 0
        data.send(("total", total, unit))

    def set_description(self, text: str) -> None:
        self._data.send(("set_description", text))

    def update(self, n: int = 1) -> None:
        self.n += n
        self._data.send(("update", n))

    def close(self) -> None:
        pass


def main(data_fd: int, ctrl_fd: int) -> int:
    data = Connection(data_fd, readable=False)
    ctrl = Connection(ctrl_fd, writable=False)  # kept open: the parent's last word is ("stop",)
    init = ctrl.recv()
    sys.path[:0] = [entry for entry in init["sys_path"] if entry not in sys.path]
    with contextlib.suppress(OSError):
        os.chdir(init["cwd"])
    try:
        diagnosis = diagnose_here(cloudpickle.loads(init["pipeline"]), **init["options"],
                                  bar_factory=lambda total, unit: _RemoteBar(data, total, unit))
        data.send(("done", str(diagnosis.to_json(init["result"]))))
    except BaseException as exc:  # shipped to the parent, which raises it
        data.send(("error", type(exc).__name__, str(exc), traceback.format_exc(),
                   getattr(exc, "stage", None), getattr(exc, "index", None)))
        return 1
    return 0


if __name__ == "__main__":
    # Not sys.exit: a daemon thread left in a stage must not free torch tensors during finalization.
    exit_without_finalizing(main(int(sys.argv[1]), int(sys.argv[2])))
