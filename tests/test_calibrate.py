"""The schedule's cells: which prompts each repeat of a cell decodes."""

from specbatch.tools.calibrate import CELL_PROMPTS, cell_batches


def test_a_narrow_cell_decodes_several_prompts_and_each_repeat_others():
    prompts = list(range(16))  # stand-ins for the workload's prompts (chat at even, code at odd)
    one = [cell_batches(prompts, 1, r) for r in range(3)]
    assert [len(b) for b in one] == [CELL_PROMPTS] * 3 and all(len(batch) == 1 for b in one for batch in b)
    assert one[0] == [[0], [1], [2], [3]] and one[1] == [[4], [5], [6], [7]]  # chat and code, new ones each repeat
    assert cell_batches(prompts, 2, 0) == [[0, 1], [2, 3]] and cell_batches(prompts, 2, 1) == [[4, 5], [6, 7]]
    assert cell_batches(prompts, 16, 1) == [prompts]  # wide cells: one batch of the whole workload
    assert cell_batches(prompts, 4, 4) == [[0, 1, 2, 3]]  # wraps around the workload


def test_every_cell_keeps_its_rate_end_to_end_and_decoding_alone(tiny, tiny_draft):
    import argparse

    from specbatch.runtime.config import EngineConfig
    from specbatch.tools.bench.harness import Context, code_prompts
    from specbatch.tools.calibrate import TEMPERATURES, measure_schedule
    ctx = Context(tiny, tiny_draft, EngineConfig(num_draft_tokens=1), [1, 2], 4, 1)
    args = argparse.Namespace(widths="1,2", draft_lengths="1", tokens=4, repeats=1, margin=0.03)
    try:
        schedule, table = measure_schedule(ctx, code_prompts(tiny.tokenizer, 2), args)
    finally:
        ctx.close()
    cells = [f"T={t} width={w}" for t in TEMPERATURES for w in (1, 2)]
    decode = table.pop("decode")
    assert set(decode) <= set(cells) and set(decode) == set(table["cell_acceptance"])
    for key, rates in decode.items():
        assert set(rates) == set(table[key]) == {"0", "1"} and all(v > 0 for v in rates.values())
    assert list(schedule.widths) == [1, 2]
