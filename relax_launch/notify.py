"""Notifications to the operator (``logging.notify``) through Apprise, one message per event: the
job is up, finished, failed (with its last line), stopped, restarted by itself, or a checkpoint
failed. Rank 0 sends ``up`` and checkpoint failures; ``relax-launch run`` (and an sbatch script's
end) sends how the job ended and its restarts, which rank 0 cannot when it is the one that died.

A notification never fails the job nor holds it for long: each is sent from a thread of its own,
and whoever waits for one (a command about to exit) waits at most ``SEND_BOUND_S``. A failed send
is logged (on a rank, to its own log; in ``relax-launch run``, one line on the console).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import apprise

log = logging.getLogger(__name__)
# Apprise logs each failed delivery in detail: kept out of `relax-launch run`'s console (which
# has no logging set up; Python would print them there); a rank's log handlers still get them.
logging.getLogger("apprise").addHandler(logging.NullHandler())

SEND_BOUND_S = 10.0  # how long a command about to exit waits for its last notification
KINDS = {  # event -> Apprise's message type (the colour or icon a service shows)
    "up": apprise.NotifyType.INFO,
    "finished": apprise.NotifyType.SUCCESS,
    "failed": apprise.NotifyType.FAILURE,
    "stopped": apprise.NotifyType.WARNING,
    "restarted": apprise.NotifyType.WARNING,
    "checkpoint failed": apprise.NotifyType.FAILURE,
}


def url_problems(urls: Sequence[str]) -> list[str]:
    """What is wrong with each URL Apprise cannot use (no scheme it knows, a malformed one)."""
    problems = []
    for index, url in enumerate(urls):
        if apprise.Apprise.instantiate(url) is None:
            problems.append(
                f"[{index}] {url!r} is not a notification URL Apprise can use (its schemes: "
                "https://github.com/caronc/apprise/wiki, e.g. json://host:port/path, "
                "slack://..., mailto://...)"
            )
    return problems


class Notifier:
    """Sends the job's events to ``urls`` (none: every send does nothing)."""

    def __init__(self, urls: Sequence[str], job_name: str) -> None:
        self.job_name = job_name
        self.apprise = apprise.Apprise()
        for url in urls:
            self.apprise.add(url)  # checked by the config already (url_problems)

    def send(self, event: str, text: str, wait_s: float = 0.0) -> None:
        """Send ``event`` with ``text`` from a thread; wait at most ``wait_s`` for it."""
        if not len(self.apprise):
            return
        sender = threading.Thread(
            target=self._deliver, args=(event, text), name=f"notify-{event}", daemon=True
        )
        sender.start()
        if wait_s > 0:
            sender.join(timeout=wait_s)
            if sender.is_alive():
                log.warning(f"relax-launch: notification {event!r} still sending after {wait_s} s")

    def _deliver(self, event: str, text: str) -> None:
        title = f"relax-launch {self.job_name}: {event}"
        try:
            with apprise.LogCapture(level=logging.WARNING) as captured:
                delivered = self.apprise.notify(body=text, title=title, notify_type=KINDS[event])
            details = captured.getvalue().strip().splitlines()
        except Exception as exc:  # noqa: BLE001 - a notification never ends the job
            delivered, details = False, [f"{type(exc).__name__}: {exc}"]
        if not delivered:
            why = details[-1] if details else "no reason given"
            log.warning(
                f"relax-launch: notification {event!r} not delivered to every logging.notify "
                f"URL ({why})"
            )
