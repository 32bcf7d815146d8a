"""The bookkeeping of verification graphs (k + 1 query tokens a row): where each real token goes
in the padded layout, and which batch sizes get a graph. (That graphed verification gives the
tokens of eager verification: tests/platform/engine/test_speculative.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.platform.runner.cuda_graph import CudaGraphRunner, capture_sizes, verify_layout


@pytest.mark.parametrize(
    ("query_lens", "query_len", "rows"),
    [
        ([1], 1, [0]),
        ([4], 4, [0, 1, 2, 3]),
        ([1, 4, 2], 4, [3, 4, 5, 6, 7, 10, 11]),  # each row's tokens end its 4 slots
        ([3, 3], 5, [2, 3, 4, 7, 8, 9]),
        ([], 3, []),
    ],
)
def test_verify_layout_puts_each_rows_tokens_last_in_its_slots(query_lens, query_len, rows):
    assert verify_layout(np.array(query_lens), query_len).tolist() == rows


@pytest.mark.parametrize("bad", [[0], [5], [2, 6]])
def test_verify_layout_refuses_a_row_longer_than_the_graph(bad):
    with pytest.raises(ValueError, match="query lengths"):
        verify_layout(np.array(bad), 4)


def test_verify_graph_sizes_stop_at_the_verify_bound():
    runner = CudaGraphRunner(
        torch.nn.Identity(), [], 40, 8, torch.device("cpu"), verify_query_len=4, verify_max_bs=20
    )
    assert runner.sizes == capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert runner.verify_sizes == [1, 2, 4, 8, 16, 20]
    assert runner.input_ids.shape == (80,)  # 20 rows x 4 tokens > 40 decode rows
    plain = CudaGraphRunner(torch.nn.Identity(), [], 8, 8, torch.device("cpu"))
    assert plain.verify_sizes == [] and plain.input_ids.shape == (8,)
