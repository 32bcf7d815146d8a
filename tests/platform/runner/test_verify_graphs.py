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


class _Echo(torch.nn.Module):
    """A stand-in model whose logits are its input ids (two columns)."""

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return input_ids.float()[:, None].repeat(1, 2)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def test_a_step_on_few_adapters_replays_the_graph_captured_for_few():
    """Where the LoRA kernels for few adapters differ (here 96-128 tokens, at most tokens / 12
    adapters), a third graph is captured with them; a step replays it when it holds at most
    that many distinct adapters, the graph for any count when it holds more, the base graph
    when it holds none."""
    from types import SimpleNamespace

    calls: list[tuple[int, bool, int | None]] = []
    runner = CudaGraphRunner(
        _Echo(), [], 128, 4, torch.device("cpu"),
        before_replay=lambda t, slots, few: calls.append((t, slots is not None, few)),
        few_adapters=lambda t: t // 12 if 96 <= t <= 128 else None,
    )  # fmt: skip
    runner.capture()
    assert set(runner.few_graphs) == {96, 112, 128}
    assert set(runner.graphs) == set(runner.base_graphs) == set(capture_sizes(128))
    assert sorted(c for c in calls if c[2] is not None) == [(96, True, 8), (112, True, 9),
                                                           (128, True, 10)]  # fmt: skip
    replays: dict[str, int] = {}
    for kind, graphs in (("few", runner.few_graphs), ("lora", runner.graphs),
                         ("base", runner.base_graphs)):  # fmt: skip
        graph = graphs[112]
        graph.replay = lambda kind=kind, real=graph.replay: (
            replays.__setitem__(kind, replays.get(kind, 0) + 1) or real()
        )

    def step(adapters: int) -> torch.Tensor:
        n = 100
        slots = (np.arange(n) % adapters).astype(np.int32) if adapters else np.full(n, -1)
        batch = SimpleNamespace(
            input_ids=np.arange(n, dtype=np.int64), positions=np.zeros(n, dtype=np.int64),
            slot_mapping=np.arange(n, dtype=np.int64), seq_lens=np.ones(n, dtype=np.int32),
            block_tables=np.zeros((n, 1), dtype=np.int32), lora_slots=slots,
            any_lora=adapters > 0,
        )  # fmt: skip
        with torch.inference_mode():  # as the runner replays
            return runner.run(batch)

    calls.clear()
    assert step(9)[:, 0].tolist() == list(range(100))
    assert replays == {"few": 1} and calls[-1][0] == 112 and calls[-1][2] == 9
    step(10)
    assert replays == {"few": 1, "lora": 1} and calls[-1][2] is None
    step(0)
    assert replays == {"few": 1, "lora": 1, "base": 1} and calls[-1][1:] == (False, None)
