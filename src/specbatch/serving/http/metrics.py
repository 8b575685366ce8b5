"""Prometheus text exposition of ``engine.stats()``."""

from __future__ import annotations


def _line(name: str, value, labels: dict | None = None) -> str:
    tags = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
    return f"{name}{{{tags}}} {value}" if tags else f"{name} {value}"


def _histogram(name: str, help_text: str, snap: dict) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    out += [_line(f"{name}_bucket", n, {"le": le}) for le, n in snap["buckets"].items()]
    out += [_line(f"{name}_sum", snap["sum"]), _line(f"{name}_count", snap["count"])]
    return out


def render_metrics(stats: dict) -> str:
    counters = [
        ("specbatch_requests_total", "requests submitted", stats["requests_submitted"]),
        ("specbatch_requests_finished_total", "requests finished", stats["requests_finished"]),
        ("specbatch_prompt_tokens_total", "prompt tokens of finished requests", stats["prompt_tokens"]),
        ("specbatch_generated_tokens_total", "tokens emitted to finished requests", stats["generated_tokens"]),
        ("specbatch_rounds_total", "decode rounds", stats["rounds"]),
        ("specbatch_spec_rounds_total", "verify rounds", stats["spec_rounds"]),
        ("specbatch_lookup_rounds_total", "verify rounds drafted by prompt lookup", stats.get("lookup_rounds", 0)),
        ("specbatch_drafted_tokens_total", "tokens drafted", stats["drafted_tokens"]),
        ("specbatch_accepted_tokens_total", "drafted tokens accepted", stats["accepted_tokens"]),
        ("specbatch_prompt_cache_hits_total", "prompt-cache hits", stats.get("prompt_cache_hits", 0)),
        ("specbatch_prompt_cache_misses_total", "prompt-cache misses", stats.get("prompt_cache_misses", 0)),
    ]
    out = []
    for name, help_text, value in counters:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", _line(name, value)]
    out += ["# HELP specbatch_finished_total finished requests by reason", "# TYPE specbatch_finished_total counter"]
    out += [_line("specbatch_finished_total", n, {"reason": r}) for r, n in sorted(stats["finish_reasons"].items())]
    out += ["# HELP specbatch_transitions_total state-machine transitions by kind",
            "# TYPE specbatch_transitions_total counter"]
    out += [_line("specbatch_transitions_total", n, {"kind": k}) for k, n in sorted(stats["transitions"].items())]
    gauges = [("specbatch_live_width", "rows decoding now", stats["width"]),
              ("specbatch_queue_depth", "requests waiting for admission", stats["queue_depth"]),
              ("specbatch_queued_prompt_tokens", "prompt tokens of the requests waiting",
               stats.get("queued_prompt_tokens", 0)),
              ("specbatch_kv_bytes", "target KV bytes allocated", stats["kv_bytes"]),
              ("specbatch_kv_used_bytes", "target KV bytes the held tokens need", stats["kv_used_bytes"]),
              ("specbatch_drafter_kv_bytes", "drafter KV bytes allocated", stats["drafter_kv_bytes"]),
              ("specbatch_prompt_cache_bytes", "prompt-cache bytes held", stats.get("prompt_cache_bytes", 0)),
              ("specbatch_prefilling", "requests prefilling: long arrivals between rounds, and prompts "
               "prefilled at admission", stats.get("prefilling", 0)),
              ("specbatch_admitting", "requests prefilled at admission now (out of the queue, no token yet; a "
               "long prompt prefilled whole shows here)", stats.get("admitting", 0)),
              ("specbatch_admitting_prompt_tokens", "prompt tokens of those requests",
               stats.get("admitting_prompt_tokens", 0)),
              ("specbatch_prefill_tokens", "prompt tokens those arrivals have prefilled so far", stats.get("prefill_tokens", 0)),
              ("specbatch_prefill_kv_bytes", "KV bytes held by arrivals still prefilling", stats.get("prefill_kv_bytes", 0))]
    for name, help_text, value in gauges:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", _line(name, value)]
    out += ["# HELP specbatch_state current machine state (1 = current)", "# TYPE specbatch_state gauge"]
    out += [_line("specbatch_state", int(stats["state"] == s), {"state": s}) for s in ("Idle", "Scalar", "Batched", "Gated")]
    out += _histogram("specbatch_ttft_seconds", "time to first token", stats["ttft_seconds"])
    out += _histogram("specbatch_itl_seconds", "inter-token latency", stats["itl_seconds"])
    return "\n".join(out) + "\n"
