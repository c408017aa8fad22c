"""`serve_in_thread`: the app of an `lmrl.serve.endpoint.Endpoint` under uvicorn in a
background thread, on loopback and a port the system picks unless told otherwise."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from lmrl.serve.app import build_app
from lmrl.serve.endpoint import Endpoint

__all__ = ["Running", "serve_in_thread"]


@dataclass
class Running:
    """An endpoint served in a background thread."""

    endpoint: Endpoint
    server: Any  # uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def episode_url(self, episode: str) -> str:
        """The base URL of ``episode`` alone (another episode's key is refused there)."""
        return self.base_url.removesuffix("/v1") + f"/episodes/{episode}/v1"

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let the running ones finish, stop the server."""
        self.endpoint.stopping = True
        self.server.should_exit = True
        self.thread.join(timeout)
        self.endpoint.stop()


def serve_in_thread(
    endpoint: Endpoint, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0
) -> Running:
    """Serve ``endpoint``'s app with uvicorn in a daemon thread; returns once it listens.

    Args:
        host: the address to bind: loopback unless told otherwise.
        port: the port; 0 = one the system picks (read back in `Running.port`).

    Raises:
        OSError: the address cannot be bound.
    """
    import uvicorn

    config = uvicorn.Config(
        build_app(endpoint),
        host=host,
        port=port,
        log_level="critical",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as err:  # uvicorn exits (SystemExit) when it cannot start
            failed.append(err.__context__ or err)

    thread = threading.Thread(target=run, name="lmrl-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            endpoint.stop()
            why = f": {failed[0]}" if failed else ""
            raise OSError(f"the endpoint could not start on {host}:{port}{why}")
        time.sleep(0.01)
    sockets = [s for srv in server.servers for s in srv.sockets]
    return Running(endpoint, server, thread, host, int(sockets[0].getsockname()[1]))
