"""``make bench``: the harness, its suites and the report (``run`` picks suites)."""
