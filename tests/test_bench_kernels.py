"""The kernels bench suite's long-prompt measurement runs end to end on a tiny model (figures
not checked, only that both systems decoded every token asked)."""

from __future__ import annotations

from specbatch.runtime.config import EngineConfig
from specbatch.tools.bench.harness import Context
from specbatch.tools.bench.kernels import long_prompt
from specbatch.tools.bench.long import long_prompts


def test_long_prompt_times_both_systems_first_token_and_decode(tiny):
    ctx = Context(tiny, None, EngineConfig(), [1], 8, 1)
    try:
        got = long_prompt(ctx, ctx.engine(speculation=False), long_prompts(tiny.tokenizer, 60, 1)[0], tokens=4)
    finally:
        ctx.close()
    assert set(got) == {f"{s}_{f}" for s in ("specbatch", "mlx_lm") for f in ("ttft_s", "decode_ms", "tokens")}
    assert got["specbatch_tokens"] == got["mlx_lm_tokens"] == 5  # the first and 4 more, none cut by an end
    assert all(v > 0 for v in got.values())
