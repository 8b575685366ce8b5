"""Embedding specbatch as the scheduling core of another server: Python's own http.server.

Each handler thread submits to the shared Engine and streams the events back as
newline-delimited JSON; the engine thread batches and speculates across all of them.

    python -m specbatch.blas examples/embed_http_server.py --port 8100
    curl -N localhost:8100 -d '{"prompt": "def fibonacci(n):", "max_tokens": 32}'
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from specbatch import Engine, InvalidRequest, SamplingParams, from_pretrained


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                params = SamplingParams(max_tokens=body.get("max_tokens", 64),
                                        temperature=body.get("temperature", 0.0), seed=body.get("seed"))
                handle = engine.submit(body["prompt"], params)
            except (InvalidRequest, ValueError, TypeError, KeyError) as exc:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(json.dumps({"error": str(exc)}).encode())
                return
            self.send_response(200)
            self.send_header("content-type", "application/x-ndjson")
            self.end_headers()
            try:
                for event in handle:
                    self.wfile.write(json.dumps({"text": event.text, "finish_reason": event.finish_reason}).encode() + b"\n")
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                engine.cancel(handle)  # the client left: free its row at the next round

        def log_message(self, *args):
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    with from_pretrained(args.model) as engine:
        ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(engine)).serve_forever()


if __name__ == "__main__":
    main()
