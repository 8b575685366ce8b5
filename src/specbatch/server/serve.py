"""``specbatch serve``: uvicorn around the app, with a shutdown that exits 0."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import uvicorn

from .app import create_app


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after its graceful shutdown (exit 143); a clean stop is 0."""

    on_signal: list = []  # also called on SIGINT / SIGTERM

    @contextlib.contextmanager
    def capture_signals(self):
        def stop(*_):
            self.should_exit = True  # stop accepting; in-flight responses finish
            for callback in self.on_signal:
                callback()
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(args, engine) -> int:
    api_key = args.api_key or os.environ.get("SPECBATCH_API_KEY") or None
    app = create_app(engine, args.served_model_name, api_key=api_key, max_body=args.max_body)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=30))
    failures: list[str] = []

    def stop_serving(error: str) -> None:  # the engine cannot go on (a lost peer rank)
        failures.append(error)
        server.should_exit = True

    engine.on_failure(stop_serving)
    server.on_signal = []
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
    return 0
