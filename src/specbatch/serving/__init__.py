"""Serving: the ``specbatch`` command line, the OpenAI-compatible HTTP server, and a target
sharded across processes."""
