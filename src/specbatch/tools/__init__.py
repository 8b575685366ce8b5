"""Tooling around the core: benchmarks, calibration's measuring, the demo, statecharts and
the prompts they decode."""
