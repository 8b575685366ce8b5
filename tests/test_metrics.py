"""The Prometheus text carries every counter and gauge of a live core's stats."""

from __future__ import annotations

from specbatch import SamplingParams
from specbatch.kernels.models import LoadedModel
from specbatch.runtime.config import EngineConfig
from specbatch.serving.http.metrics import render_metrics
from specbatch.testing.fake import FakeModel
from specbatch.kernels.build import new_core


def test_metrics_show_an_arrival_prefilling_between_rounds(tiny):
    target = LoadedModel(FakeModel(), tiny.tokenizer, "fake-target", 4096)
    config = EngineConfig(num_draft_tokens=3, prefill_chunk=8, prompt_cache_bytes=0, speculation=False)
    with new_core(target, None, config) as core:
        core.add([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
        core.step()
        core.add(list(range(3, 33)), SamplingParams(max_tokens=4, ignore_eos=True))
        while core.stats()["prefill_tokens"] == 0:
            core.step()
        stats = core.stats()
        text = render_metrics(stats)
        assert stats["prefilling"] == 1 and 0 < stats["prefill_tokens"] < 30
        assert "specbatch_prefilling 1\n" in text
        assert f"specbatch_prefill_tokens {stats['prefill_tokens']}\n" in text
        assert f"specbatch_prefill_kv_bytes {stats['prefill_kv_bytes']}\n" in text
        assert f"specbatch_state{{state=\"{core.state}\"}} 1\n" in text and "specbatch_live_width 1\n" in text
        while core.has_work():
            core.step()
        assert "specbatch_prefilling 0\n" in render_metrics(core.stats())
