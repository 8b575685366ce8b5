"""Tree drafting on the embedded target (SmolLM2-135M-Instruct): tree-verified streams
equal plain decoding, greedy and seeded, with prompt lookup and the trained MTP head."""

from __future__ import annotations

import pytest
from test_real_target import QUESTIONS, run, smol  # noqa: F401 (the module-scoped target)

from specbatch import SamplingParams
from specbatch.runtime.config import EngineConfig
from specbatch.kernels.models import ModelNotFound, chat_prompt as chat, demo_path, load_mtp_head
from specbatch.kernels.build import new_core

pytestmark = pytest.mark.slow


def drafters(target):
    from specbatch.kernels.drafters.ngram import NGramSource
    out = {"ngram": NGramSource(target.vocab_size)}
    for folder in (demo_path("mtp"), demo_path("mtp").with_name("mtp-candidate")):
        try:
            out["mtp"] = load_mtp_head(folder, target)
            break
        except ModelNotFound:
            continue
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tree_speculation_equals_plain(smol, temperature):  # noqa: F811
    jobs = [(chat(smol.tokenizer, q), SamplingParams(max_tokens=32, temperature=temperature, seed=3 + i))
            for i, q in enumerate(QUESTIONS[:2])]
    with new_core(smol, None, EngineConfig(speculation=False)) as plain:
        ref = [run(plain, [job])[0] for job in jobs]
    for name, drafter in drafters(smol).items():
        config = EngineConfig(speculative_width_cap=0, num_draft_tokens=3, tree_shape="2,1,1")
        with new_core(smol, drafter, config) as core:
            got = [run(core, [job])[0] for job in jobs]
            assert core.stats()["spec_rounds"] > 0, name
        assert got == ref, name
