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
