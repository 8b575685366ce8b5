"""Statecharts generated from the live machine: write, check, and trace a recorded run.

``statecharts/machine.mmd`` is never hand-edited: ``specbatch statechart --write``
renders it from ``machine.TRANSITIONS`` through transitions' Mermaid engine, and a test
fails when the two differ. ``--trace LOG`` reads a JSON log of a run and draws which
transitions it actually took, with counts.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

from ..runtime.machine import ROUNDS, STATES, TRANSITIONS, TRIGGERS, build_machine

CHART = Path("statecharts") / "machine.mmd"


def render() -> str:
    """The machine's Mermaid chart, normalised (no runtime styling, no trailing spaces)."""
    from transitions.extensions import GraphMachine

    class Stub:
        pass

    stub = Stub()
    build_machine(stub, cls=GraphMachine, graph_engine="mermaid", show_conditions=True,
                  title="specbatch: speculative batching")
    raw = stub.get_graph().draw(None)
    lines = [ln.rstrip() for ln in raw.splitlines() if not ln.strip().startswith(("Class ", "classDef "))]
    lines = [ln for i, ln in enumerate(lines) if ln or (i and lines[i - 1])]
    notes = ["", "  %% Idle is the diagram's [*]. Why each edge exists:"]
    for trigger, source, dest, guard, hook, why in TRANSITIONS:
        notes.append(f"  %% {trigger} ({'/'.join(source) if isinstance(source, list) else source} -> {dest}): {why}")
    notes += ["", "  %% Each state's round, in order (machine.ROUNDS); a trigger? that fires ends the round:"]
    for state, steps in ROUNDS.items():
        notes.append(f"  %% {state}: " + " > ".join(f"{s}?" if s in TRIGGERS else s for s in steps))
    return "\n".join(lines + notes) + "\n"


def trace(log_path: Path) -> str:
    """A chart of the transitions a recorded run (structlog JSON lines) took, with counts."""
    taken = collections.Counter()
    for line in log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "transition":
            taken[(event["source"], event["dest"], event["trigger"])] += 1
    out = ["stateDiagram-v2", "  direction LR", *(f"  state \"{s}\" as {s}" for s in STATES), "  [*] --> Idle"]
    for (source, dest, trigger), n in sorted(taken.items()):
        out.append(f"  {source} --> {dest}: {trigger} x{n}")
    edges = {(s, d, t) for t, src, d, *_ in TRANSITIONS for s in (src if isinstance(src, list) else [src])}
    untaken = sorted(edges - set(taken))
    out += [f"  %% not taken: {s} -> {d} ({t})" for s, d, t in untaken]
    return "\n".join(out) + "\n"


def write_svg(mmd: Path) -> Path | None:
    """An SVG beside the chart for reviewers, through Graphviz where ``dot`` exists."""
    if shutil.which("dot") is None:
        return None
    from transitions.extensions import GraphMachine

    class Stub:
        pass

    stub = Stub()
    build_machine(stub, cls=GraphMachine, graph_engine="graphviz", show_conditions=True,
                  title="specbatch: speculative batching")
    dot_src = stub.get_graph().source
    svg = mmd.with_suffix(".svg")
    svg.write_bytes(subprocess.run(["dot", "-Tsvg"], input=dot_src.encode(), capture_output=True, check=True).stdout)
    return svg


def run_statechart(args) -> int:
    if args.trace:
        sys.stdout.write(trace(Path(args.trace)))
        return 0
    chart = render()
    if args.check:
        if not CHART.exists() or CHART.read_text() != chart:
            print(f"{CHART} differs from the machine: run `specbatch statechart --write`", file=sys.stderr)
            return 1
        print(f"{CHART} matches the machine")
        return 0
    if args.write:
        CHART.parent.mkdir(parents=True, exist_ok=True)
        CHART.write_text(chart)
        svg = None
        try:
            svg = write_svg(CHART)
        except Exception as exc:  # the SVG is a convenience; the .mmd is the checked artefact
            print(f"SVG not written: {exc}", file=sys.stderr)
        print(f"wrote {CHART}" + (f" and {svg}" if svg else " (no `dot`: SVG skipped)"))
        return 0
    sys.stdout.write(chart)
    return 0
