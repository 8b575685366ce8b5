"""The bench harness hands mlx-lm folders at the precision the engine runs (fp32 on the CPU)."""

from __future__ import annotations

import json

import mlx.core as mx

from specbatch.tools.bench.harness import fp32_copy, mlx_lm_folder


def test_half_precision_folders_get_an_fp32_copy_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "draft"
    src.mkdir()
    mx.save_safetensors(str(src / "model.safetensors"), {"w": mx.ones((2, 3), dtype=mx.float16),
                                                         "ids": mx.arange(4, dtype=mx.int32)})
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    out = mlx_lm_folder(str(src))
    assert out != src and (out / "config.json").exists() and (out / "tokenizer.json").exists()
    got = mx.load(str(out / "model.safetensors"))
    assert got["w"].dtype == mx.float32 and got["ids"].dtype == mx.int32 and mx.array_equal(got["w"], mx.ones((2, 3)))
    assert fp32_copy(src) == out  # cached
    assert fp32_copy(out) == out  # already fp32: used as is


def test_kernels_bench_measures_the_bound_and_both_paths(tiny):
    from specbatch.tools.bench import kernels
    model = tiny.model
    total = kernels.weight_bytes(model)
    dims = model.args.hidden_size
    assert total >= model.model.embed_tokens.weight.nbytes + dims * dims * 4
    assert kernels.sgemv_probe(model, repeats=1) > 0
    times = kernels.forward_times(model, [(1, 1), (2, 3)], repeats=1)
    assert set(times) == {(1, 1, True), (1, 1, False), (2, 3, True), (2, 3, False)}
    assert all(ms > 0 for ms in times.values())
    assert set(kernels.forward_times(model, [(2, 3)], repeats=1, mlx_ops=False)) == {(2, 3, True)}


def test_the_kernels_bench_times_the_engines_own_plain_decode(tiny):
    from specbatch.runtime.config import EngineConfig
    from specbatch.tools.bench import kernels
    from specbatch.tools.bench.harness import Context
    ctx = Context(tiny, None, EngineConfig(), [1], 8, 1)
    try:
        ms = kernels.decode_ms(ctx, ctx.engine(speculation=False), tiny.tokenizer.encode("hello there"), tokens=6)
    finally:
        ctx.close()
    assert 0 < ms < 10_000


def test_the_policy_bench_decodes_prompts_calibration_never_saw_at_mixed_temperatures(tiny):
    from specbatch.tools import workload
    from specbatch.tools.bench import policy
    tok = tiny.tokenizer
    held_out = policy.held_out_prompts(tok, 8)
    calibrated = workload.prompts(tok, 24)  # what `calibrate` and the other suites decode
    chats = [p for i, p in enumerate(held_out) if i % 2 == 0]
    assert len(held_out) == 8 and not any(p in calibrated for p in chats)

    class Recorder:  # an engine that answers at once and remembers what it was asked
        def __init__(self):
            self.asked = []

        def submit(self, prompt, params):
            self.asked.append(params)
            usage = type("Usage", (), {"completion_tokens": params.max_tokens})
            return type("Handle", (), {"result": lambda self, timeout: type("R", (), {"usage": usage})})()

    engine = Recorder()
    assert policy.mixed_tok_s(engine, held_out[:4], 2, 5) > 0
    assert [p.temperature for p in engine.asked] == [0.0, 0.7, 0.0, 0.7]
    assert len({p.seed for p in engine.asked}) == 4


def test_mlx_lm_baselines_run_a_float32_copy_of_a_half_stored_target(tmp_path, tiny):
    from specbatch.kernels import cpu
    from specbatch.kernels.cpu import half
    from specbatch.kernels.models import load
    from specbatch.runtime.config import EngineConfig
    from specbatch.testing.tiny import build_tiny_model
    from specbatch.tools.bench import kernels
    from specbatch.tools.bench.harness import Context
    assert Context(tiny, None, EngineConfig(), [1], 8, 1).mlx_lm_model is tiny.model  # float32 already
    target = load(build_tiny_model(tmp_path / "half", "llama", seed=5, half_values=True))
    if not half.half_stored(target.model):
        assert not half.supported(cpu.extension())
        return
    baseline = Context(target, None, EngineConfig(), [1], 8, 1).mlx_lm_model
    assert baseline is not target.model and not half.half_stored(baseline)
    assert kernels.weight_bytes(baseline) == 2 * kernels.weight_bytes(target.model)  # what each reads a step
    tokens = mx.array([[3, 1, 4, 1, 5]])
    assert mx.array_equal(baseline(tokens), target.model(tokens)).item()  # the same values either way


def test_a_core_run_counts_decoding_alone_from_the_step_every_row_has_its_first_token(tiny):
    from specbatch.kernels.build import new_core
    from specbatch.runtime.config import EngineConfig
    from specbatch.tools.bench.harness import code_prompts, core_tok_s
    prompts = code_prompts(tiny.tokenizer, 3)
    with new_core(tiny, None, EngineConfig(speculation=False)) as core:
        run = core_tok_s(core, prompts, 6)
        assert not core.has_work()
    # added before one step, the three rows are admitted together: each one's first token is
    # out in that step, and the five after it are what decoding alone counts
    assert run.tokens == 3 * 6 and run.decode_tokens == 3 * 5
    assert 0 < run.decode_seconds < run.seconds and run.tok_s > 0 and run.decode_tok_s > 0
