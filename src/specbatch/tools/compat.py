"""``python -m specbatch.tools.compat``: the adversarial matrix (issue 26) and the official
``openai`` client against a real ``specbatch serve`` it starts (the embedded model unless
``--model``), then the counts: 5xx, silent acceptances (a field that must be refused got a
2xx), refusals of valid requests, 4xx bodies off the OpenAI envelope or naming the wrong
param, stalled and dropped connections, server tracebacks, and the client's checks (text ==
joined logprob tokens, usage consistent). Exit status 0 when every count is clean.

The cases are in :mod:`specbatch.tools.compat_cases`; the ``openai`` package is a dev extra.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import subprocess
import sys
import time
import urllib.request

from .compat_cases import Case, client_checks, matrix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specbatch.serving.cli", "serve", "--port", str(port), "--max-queue", "64",
           "--header-timeout", str(args.header_timeout), "--body-timeout", str(args.body_timeout),
           "--served-model-name", "tiny", *(["--model", args.model] if args.model else [])]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited {server.returncode}: {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not come up")


def exchange(port: int, case: Case, timeout: float = 120.0) -> tuple[int, bytes]:
    """One request with exactly the case's bytes; status 0 when the server sent nothing."""
    head = [f"{case.method} {case.path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    if case.method == "POST":
        head += ["Content-Type: application/json", f"Content-Length: {len(case.body)}"]
    raw = "\r\n".join(head).encode() + b"".join(b"\r\n" + h for h in case.headers) + b"\r\n\r\n" + case.body
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):  # answered (413) before the body was all sent
            pass
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:  # closed with unread bytes of ours: what came before stands
            pass
    return parse_response(data)


def parse_response(data: bytes) -> tuple[int, bytes]:
    """Status and (de-chunked) body of a whole HTTP/1.1 response; 0 when nothing came."""
    head, _, body = data.partition(b"\r\n\r\n")
    if not head:
        return 0, b""
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return int(head.split(b" ")[1]), body


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return out


def verdict(case: Case, status: int, body: bytes) -> str:
    """"ok", or what went wrong (the summary counts these)."""
    if status >= 500 or status == 0:
        return "5xx"
    if case.status >= 400 and status < 400:
        return "silent_acceptance"
    if case.status < 400 and status >= 400:
        return "refused_valid"
    if status != case.status:
        return "wrong_status"
    if status < 400:
        return "ok"
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "off_envelope"
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return "off_envelope"
    if case.param is not None and err["param"] != case.param:
        return "wrong_param"
    if case.code is not None and err["code"] != case.code:
        return "wrong_code"
    return "ok"


def stalls(port: int, args) -> list[tuple[str, bool, str]]:
    """Half-sent headers and bodies are closed by the server's timeouts; clients that leave
    mid-body or mid-stream leave the server serving."""
    out = []
    for name, sent, want in [("partial_headers", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 408),
                             ("partial_request_line", b"GET /heal", 408),
                             ("partial_body", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 90"
                                              b"\r\n\r\n{\"prompt\":", 408)]:
        t = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(sent)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        waited = time.monotonic() - t
        out.append((name, data.startswith(b"HTTP/1.1 %d" % want), f"closed after {waited:.1f} s: {data[:12]!r}"))
    for name, sent in [("leave_mid_body", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 90\r\n"
                                          b"\r\n{\"prom"),
                       ("leave_mid_stream", _stream_request())]:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(sent)
            if name == "leave_mid_stream":
                sock.recv(256)  # the stream has started
        status, _ = exchange(port, Case("health", "GET", "/health", b"", 200))
        out.append((name, status == 200, f"/health then {status}"))
    return out


def crowd(port: int, streams: int = 48) -> tuple[str, bool, str]:
    """``streams`` concurrent streams, a third of whose clients leave after the first chunk:
    every stream that stays ends with ``[DONE]`` and the server still answers."""
    import concurrent.futures

    def one(i: int) -> str:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
            sock.sendall(_stream_request(max_tokens=16, seed=i))
            data = sock.recv(65536)
            if i % 3 == 0:
                return "left"
            while chunk := sock.recv(65536):
                data += chunk
        status, body = parse_response(data)
        return "done" if status == 200 and body.rstrip().endswith(b"data: [DONE]") else f"{status} {body[-80:]!r}"

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        ends = collections.Counter(pool.map(one, range(streams)))
    health, _ = exchange(port, Case("health", "GET", "/health", b"", 200))
    ok = ends["done"] + ends["left"] == streams and health == 200
    return f"crowd_{streams}_streams", ok, f"{dict(ends)}, then /health {health}"


def _stream_request(max_tokens: int = 64, seed: int = 0) -> bytes:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "seed": seed,
                       "temperature": 0.8}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def report(results, connection, client, tracebacks: int) -> bool:
    counts = collections.Counter(v for _, v, _ in results)
    print(f"matrix: {len(results)} cases: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    for case, v, got in results:
        if v != "ok":
            print(f"  {v}: {case.name}: expected {case.status} {case.param or ''}, got {got}")
    print(f"connections: {sum(ok for _, ok, _ in connection)}/{len(connection)} ok")
    for name, ok, detail in connection:
        print(f"  {'ok ' if ok else 'BAD'} {name}: {detail}")
    print(f"openai client: {sum(ok for _, ok, _ in client)}/{len(client)} ok")
    for name, ok, detail in client:
        print(f"  {'ok ' if ok else 'BAD'} {name}: {detail}")
    print(f"server tracebacks / ERROR lines: {tracebacks}")
    return (counts["ok"] == len(results) and all(ok for _, ok, _ in connection + client) and not tracebacks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbatch.tools.compat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the target to serve (default: the embedded one)")
    ap.add_argument("--header-timeout", type=float, default=2.0)
    ap.add_argument("--body-timeout", type=float, default=2.0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    port = free_port()
    server = start(args, port)
    try:
        results = []
        for case in matrix():
            status, body = exchange(port, case)
            results.append((case, verdict(case, status, body), f"{status} {body[:160]!r}"))
        connection = stalls(port, args) + [crowd(port)]
        client = client_checks(f"http://127.0.0.1:{port}/v1")
    finally:
        server.terminate()
        _, err = server.communicate(timeout=120)
    tracebacks = sum(1 for line in err.splitlines() if "Traceback" in line or " ERROR " in line or "[error" in line)
    return 0 if report(results, connection, client, tracebacks) else 1


if __name__ == "__main__":
    sys.exit(main())
