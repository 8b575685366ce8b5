"""Errors a caller can act on: each names the parameter at fault and a stable code."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input: the request is refused before it reaches the engine loop."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineClosed(RuntimeError):
    """The engine is shutting down or closed and admits no new requests."""


class QueueFull(RuntimeError):
    """Back-pressure: too many requests are waiting; retry later."""
