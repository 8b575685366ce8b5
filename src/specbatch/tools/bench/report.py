"""Bench results -> PNG plots and the markdown tables of ``docs/benchmarks.md``."""

from __future__ import annotations

import json
from pathlib import Path


def _table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    made = []
    suites = results["suites"]
    if "widths" in suites:
        rows = suites["widths"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in [("plain_tok_s", "plain batching"), ("always_spec_tok_s", "always speculate"),
                           ("specbatch_tok_s", f"specbatch (cap {suites['widths']['cap']})")]:
            ax.plot([r["width"] for r in rows], [r[key] for r in rows], marker="o", label=label)
        ax.set(xlabel="batch width", ylabel="tokens/s", title="Width sweep")
        ax.legend()
        made.append(_save(fig, out / "widths.png"))
    if "scalar" in suites:
        rows = suites["scalar"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([str(r["temperature"]) for r in rows], [r["speedup"] for r in rows])
        ax.axhline(1.0, color="gray", lw=1)
        ax.set(xlabel="temperature", ylabel="speculative / plain", title="Width 1 speedup")
        made.append(_save(fig, out / "scalar.png"))
    if "serving" in suites:
        rows = suites["serving"]["rows"]
        fig, ax = plt.subplots(figsize=(7, 4))
        rates = list(dict.fromkeys(r["rate"] for r in rows))
        systems = list(dict.fromkeys(r["system"] for r in rows))
        for i, system in enumerate(systems):
            vals = [next(r["tok_s"] for r in rows if r["system"] == system and r["rate"] == rate) for rate in rates]
            ax.bar([j + i * 0.27 for j in range(len(rates))], vals, width=0.27, label=system)
        ax.set_xticks([j + 0.27 for j in range(len(rates))], rates)
        ax.set(ylabel="tokens/s", title="Serving throughput, Poisson arrivals")
        ax.legend()
        made.append(_save(fig, out / "serving.png"))
    return made


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def merge(paths: list[Path]) -> dict:
    """Several runs' results as one report: each suite from the last run that has it (its
    file, k and cap noted beside it), machine and pair from the last run."""
    merged: dict = {"suites": {}}
    for path in paths:
        got = json.loads(Path(path).read_text())
        merged.update({k: v for k, v in got.items() if k not in ("suites", "failed")})
        for name, suite in got["suites"].items():
            merged["suites"][name] = {**suite, "source": f"{Path(path).name}, k = {got['k']}, cap = {got['cap']}"}
    merged["k"] = merged["cap"] = "per suite"
    return merged


def markdown(results: dict, images: list[Path], doc: Path) -> str:
    m = results["machine"]
    parts = ["# Benchmarks", "",
             f"Measured by `specbatch bench` on {m['platform']}, {m['cpus']} CPUs, device {m['device']}, "
             f"BLAS: {m['blas']}, MLX {m['mlx']}. Target `{Path(results['target']).name}`, drafter "
             f"`{Path(str(results['drafter'])).name}`, k = {results['k']}, cap = {results['cap']}. Systems are "
             "interleaved within each repeat and medians reported: this machine is shared and noisy, so read "
             "ratios, not absolute numbers.", ""]
    for name, suite in results["suites"].items():
        parts += [f"## {name}", ""]
        if "source" in suite:
            parts += [f"From `{suite['source']}`.", ""]
        parts += [_table(suite["rows"]), ""] if suite["rows"] else []
        for extra in ("summary", "throughput_ratios", "soak", "soak_again", "note", "skipped"):
            if extra in suite:
                parts += [f"{extra}: `{json.dumps(suite[extra])}`", ""]
    parts += [f"![{p.stem}]({Path('..') / p})" for p in images]
    return "\n".join(parts) + "\n"


def write_report(results: dict, results_path, doc: Path = Path("docs/benchmarks.md")) -> None:
    try:
        images = plots(results, Path("bench/plots"))
    except ImportError:
        images = []
        print("matplotlib is not installed: plots skipped (pip install 'specbatch[bench]')")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(markdown(results, images, doc) + f"\nRaw results: `{results_path}`.\n")
    print(f"report: {doc}" + (f", plots: {', '.join(map(str, images))}" if images else ""))
