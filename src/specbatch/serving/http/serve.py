"""``specbatch serve``: uvicorn around the app, with a shutdown that drains live requests.

Exit status: 0 when every request finished (a clean SIGTERM / SIGINT), 1 when the engine
failed (a lost peer rank), 3 when the shutdown grace ran out and live requests were cut.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import uvicorn

from .app import create_app
from .drain import CUT_WAIT_S, Drain
from .protocol import DEFAULT_HEADER_TIMEOUT_S, with_header_timeout

EXIT_CUT = 3
DEFAULT_GRACE_S = 30.0


class GracefulServer(uvicorn.Server):
    """On SIGINT / SIGTERM: stop accepting, let live requests finish for up to ``grace``
    seconds, cut the rest with an error, then uvicorn's own shutdown. uvicorn would re-raise
    the signal afterwards (exit 143); ``serve`` decides the status instead."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace: float = DEFAULT_GRACE_S):
        super().__init__(config)
        self.drain, self.grace = drain, grace
        self.on_signal: list = []  # also called on SIGINT / SIGTERM

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # embedded (tests): no signals
            yield
            return

        def stop(*_):
            self.should_exit = True
            for callback in self.on_signal:
                callback()
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting now, not after the grace
            server.close()
        await self.drain.finish(self.grace)
        await super().shutdown(sockets)


def serve(args, engine) -> int:
    api_key = args.api_key or os.environ.get("SPECBATCH_API_KEY") or None
    app = create_app(engine, args.served_model_name, api_key=api_key, max_body=args.max_body,
                     body_timeout=getattr(args, "body_timeout", 60.0))
    grace = getattr(args, "shutdown_grace", DEFAULT_GRACE_S)
    # uvicorn's own timeout only bounds what is left after the drain (non-generation requests)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            http=with_header_timeout(getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT_S)),
                            timeout_graceful_shutdown=int(CUT_WAIT_S),
                            timeout_keep_alive=int(getattr(args, "keep_alive_timeout", 5)))
    server = GracefulServer(config, app.state.drain, grace)
    failures: list[str] = []

    def stop_serving(error: str) -> None:  # the engine cannot go on (a lost peer rank)
        failures.append(error)
        server.should_exit = True

    engine.on_failure(stop_serving)
    if engine.lockstep is not None:  # mlx.launch signals every rank when one of them fails
        server.on_signal.append(engine.lockstep.peers.expect_loss)
    print(f"specbatch serving {engine.target.name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        engine.close(drain=False)
    if failures:
        print(f"specbatch: the engine stopped: {failures[0]}", file=sys.stderr, flush=True)
        return 1
    if server.drain.cut:
        print(f"specbatch: the {grace:g} s shutdown grace ran out: {server.drain.cut} request(s) were cut",
              file=sys.stderr, flush=True)
        return EXIT_CUT
    return 0
