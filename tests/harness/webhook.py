"""A local webhook that records what Apprise's ``json://127.0.0.1:PORT`` scheme posts to it (a
real HTTP server on a thread: the notifications under test travel over a real socket)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Webhook:
    """The messages posted so far (Apprise's JSON: title, message, type), oldest first."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        self.messages: list[dict] = []

    @property
    def url(self) -> str:
        return f"json://127.0.0.1:{self.server.server_address[1]}/hook"

    def events(self) -> list[str]:
        """Each message's event: its title after ``relax-launch NAME: ``."""
        return [m["title"].split(": ", 1)[1] for m in self.messages]


@contextmanager
def webhook() -> Iterator[Webhook]:
    """A webhook listening on a free port of 127.0.0.1 while the block runs."""
    messages: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            messages.append(json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    hook = Webhook(server)
    hook.messages = messages
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hook
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
