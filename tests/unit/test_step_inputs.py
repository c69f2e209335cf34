"""StepStager: a batch's integer inputs in one buffer, each field what the runner expects."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.req_table import ReqToTokenTable
from services.worker.step_inputs import StepStager

batches = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_fields_match_a_per_request_loop(reqs):
    rows = list(range(len(reqs)))[::-1]  # table rows in another order than the requests
    prefix = [p for p, _ in reqs]
    ids = [np.arange(e, dtype=np.int32) + 100 * b for b, (_, e) in enumerate(reqs)]
    out = [np.arange(e, dtype=np.int32) + 1000 * (b + 1) for b, (_, e) in enumerate(reqs)]
    step = StepStager(torch.device("cpu")).stage(ids, out, rows, prefix)
    want_pos = [p + i for p, e in reqs for i in range(e)]
    want_rows = [rows[b] for b, (_, e) in enumerate(reqs) for _ in range(e)]
    assert step.input_ids.tolist() == np.concatenate(ids).tolist()
    assert step.positions.tolist() == want_pos
    assert step.out_slots.tolist() == np.concatenate(out).tolist()
    assert step.token_rows.tolist() == want_rows
    assert step.req_slots.tolist() == rows and step.req_slots.dtype == torch.int32
    assert step.prefix_lens.tolist() == prefix
    assert step.extend_lens.tolist() == [e for _, e in reqs]
    assert step.seq_lens.tolist() == [p + e for p, e in reqs]
    assert (
        step.qo_indptr.tolist() == np.concatenate([[0], np.cumsum([e for _, e in reqs])]).tolist()
    )
    assert step.max_seq_len == max(p + e for p, e in reqs)
    assert step.max_extend_len == max(e for _, e in reqs)


def test_table_writes_land_at_row_and_position():
    table = ReqToTokenTable(3, 16, torch.device("cpu"))
    table.write_prefix(2, torch.tensor([5, 6, 7]))
    step = StepStager(torch.device("cpu")).stage(
        [np.array([1, 2], np.int32), np.array([3], np.int32)],
        [np.array([40, 41], np.int32), np.array([50], np.int32)],
        [2, 0],
        [3, 0],
    )
    table.write_tokens(step.token_rows, step.positions, step.out_slots)
    assert table.row(2, 5).tolist() == [5, 6, 7, 40, 41]
    assert table.row(0, 1).tolist() == [50]
    assert table.table[table.padding_row].count_nonzero() == 0
