"""Notifications (``logging.notify``) never fail the job nor hold it: a URL that refuses or never
answers costs a logged line and at most the wait the caller chose."""

from __future__ import annotations

import socket
import threading

from harness.webhook import webhook

from relax_launch.notify import Notifier


def test_an_event_reaches_the_webhook_with_its_title_and_text():
    with webhook() as hook:
        Notifier([hook.url], "demo").send("finished", "every step ran", wait_s=10)
    [message] = hook.messages
    assert message["title"] == "relax-launch demo: finished"
    assert message["message"] == "every step ran" and message["type"] == "success"


def test_a_refused_notification_is_logged_and_nothing_more(caplog):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    Notifier([f"json://127.0.0.1:{port}"], "demo").send("failed", "x", wait_s=10)
    # the delivery ended, refused, within the sender's wait (not by the wait running out)
    assert "notification 'failed' not delivered" in caplog.text
    assert "still sending" not in caplog.text


def test_a_webhook_that_never_answers_holds_the_sender_only_as_long_as_it_waits(caplog):
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        Notifier([f"json://127.0.0.1:{silent.getsockname()[1]}"], "demo").send("up", "x", wait_s=1)
        # the sender returned at its wait, the delivery still in flight (never answered)
        sending = [t for t in threading.enumerate() if t.name == "notify-up" and t.is_alive()]
        assert len(sending) == 1
    assert "notification 'up' still sending after 1 s" in caplog.text
