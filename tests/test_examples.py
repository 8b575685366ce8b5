"""The embedding example serves real requests through a shared engine."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx

from specbatch.runtime.config import EngineConfig
from specbatch.kernels.build import new_engine


def test_http_server_example(tiny):
    path = Path(__file__).parents[1] / "examples" / "embed_http_server.py"
    spec = importlib.util.spec_from_file_location("embed_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with new_engine(tiny, tiny, EngineConfig(num_draft_tokens=2)) as engine:
        server = ThreadingHTTPServer(("127.0.0.1", 0), module.make_handler(engine))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            lines = httpx.post(url, json={"prompt": "def f(x):", "max_tokens": 6}, timeout=60).text.splitlines()
            events = [json.loads(line) for line in lines]
            assert events[-1]["finish_reason"] in ("length", "stop") and len(events) <= 6
            assert httpx.post(url, json={"prompt": "", "max_tokens": 6}).status_code == 400
        finally:
            server.shutdown()
