"""Noticing switch restarts from the controller (docs/restart.md).

A restarted `fanin switch` comes back with a new incarnation and no jobs;
its workers wait in recovery until the job is back. The watcher polls every
programmed switch's incarnation (`Controller.reconcile`) and re-installs the
jobs and tree roles of those that changed, so recovery does not depend on a
worker telling the controller anything.
"""

from __future__ import annotations

import logging
import threading

from .service import Controller

log = logging.getLogger(__name__)


class RestartWatcher:
    """Calls ``controller.reconcile()`` every ``period_s`` on a daemon thread."""

    def __init__(self, controller: Controller, period_s: float = 0.25) -> None:
        self.controller = controller
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fanin-restart-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                for switch, job_id in self.controller.reconcile():
                    log.warning("switch %s restarted: re-installed job %d", switch, job_id)
            except Exception:  # keep watching; the next poll retries
                log.exception("reconciling switches failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
