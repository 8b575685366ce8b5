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


class Watched(FakeModel):
    """Calls ``on_prefill()`` at each forward of more than one position (with speculation
    off, only prefills have them): the stats a reader sees while a prefill runs."""

    def __init__(self):
        super().__init__()
        self.on_prefill = lambda: None

    def __call__(self, tokens, cache=None):
        if tokens.shape[1] > 1:
            self.on_prefill()
        return super().__call__(tokens, cache)


def watched_core(tiny, **options):
    model = Watched()
    target = LoadedModel(model, tiny.tokenizer, "fake-target", 4096)
    config = EngineConfig(prefill_chunk=8, prompt_cache_bytes=0, speculation=False, **options)
    return model, new_core(target, None, config)


def test_a_prompt_prefilled_whole_at_admission_shows_as_prefilling(tiny):
    model, core = watched_core(tiny)
    seen = []
    model.on_prefill = lambda: seen.append(core.stats())
    with core:
        core.add(list(range(3, 33)), SamplingParams(max_tokens=4, ignore_eos=True))
        core.step()  # an idle engine admits it at once: all 30 tokens in this one step
        assert seen  # every prefill forward of it (however its chunks are cut or merged) saw it
        for stats in seen:
            assert stats["prefilling"] == 1 and stats["admitting"] == 1 and stats["admitting_prompt_tokens"] == 30
            assert stats["queue_depth"] == 0 and stats["width"] == 0
        assert "specbatch_admitting_prompt_tokens 30\n" in render_metrics(seen[0])
        after = core.stats()
        assert after["admitting"] == 0 and after["prefilling"] == 0 and after["admitting_prompt_tokens"] == 0


def test_without_chunked_prefill_a_long_arrival_shows_while_rows_wait(tiny):
    model, core = watched_core(tiny, chunked_prefill=False)
    seen = []
    with core:
        core.add([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
        core.step()
        model.on_prefill = lambda: seen.append(core.stats())
        core.add(list(range(3, 43)), SamplingParams(max_tokens=4, ignore_eos=True))
        while not seen:
            core.step()
        assert seen[0]["admitting"] == 1 and seen[0]["admitting_prompt_tokens"] == 40
        assert seen[0]["queue_depth"] == 0 and seen[0]["prefilling"] == 1
        while core.has_work():
            core.step()
        assert core.stats()["admitting"] == 0
