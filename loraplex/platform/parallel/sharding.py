"""Which slice of each weight one rank holds (Megatron-style tensor parallelism).

Column-parallel layers (q/k/v, gate/up) split their output features, row-parallel ones (o,
down) their input features; the embedding and the LM head split the vocabulary. Attention
heads stay whole: rank r holds query heads [r * H / tp, (r + 1) * H / tp) and the KV heads
they read; with fewer KV heads than ranks, each KV head is held (replicated) by the tp / KV
ranks whose query heads use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.parallel.parallel_state import TensorParallel

Range = tuple[int, int]  # (start, size) along one dimension of the full tensor


@dataclass(frozen=True)
class LinearShard:
    """The part of a linear layer's full (checkpoint) weight one rank holds.

    `kind` "column": shard i of the merged layer holds output features `output_ranges[i]` of
    that checkpoint projection, and the whole input. "row": the input features `input_range`
    and the whole output; the partial outputs are summed over the ranks (one all-reduce)."""

    kind: str
    output_ranges: tuple[Range, ...]
    input_range: Range

    def __post_init__(self) -> None:
        if self.kind not in ("column", "row"):
            raise ValueError(f"a linear shard is 'column' or 'row', got {self.kind!r}")

    @property
    def output_sizes(self) -> list[int]:
        return [size for _, size in self.output_ranges]

    @property
    def input_size(self) -> int:
        return self.input_range[1]


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(
            f"--tensor-parallel-size {parts} does not divide the model's {what} ({total}); "
            f"use a size that divides it"
        )
    return total // parts


def column_shard(output_sizes: list[int], input_size: int, tp: TensorParallel) -> LinearShard:
    """Each checkpoint projection's outputs split evenly (gate/up)."""
    ranges = []
    for size in output_sizes:
        part = divide(size, tp.size, "intermediate size")
        ranges.append((tp.rank * part, part))
    return LinearShard("column", tuple(ranges), (0, input_size))


def row_shard(output_size: int, input_size: int, tp: TensorParallel, what: str) -> LinearShard:
    """The inputs split evenly (o_proj over heads, down_proj over the intermediate size)."""
    part = divide(input_size, tp.size, what)
    return LinearShard("row", ((0, output_size),), (tp.rank * part, part))


@dataclass(frozen=True)
class AttentionShard:
    """One rank's attention heads: query heads `[q_start, q_start + num_heads)`, KV heads
    `[kv_start, kv_start + num_kv_heads)`."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def attention_shard(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> AttentionShard:
    """Split the heads; refuses a size that would cut a head group."""
    local_heads = divide(num_heads, tp.size, "attention heads")
    if num_kv_heads >= tp.size:
        local_kv = divide(num_kv_heads, tp.size, "KV heads")
        kv_start = tp.rank * local_kv
    else:
        if tp.size % num_kv_heads:
            raise ValueError(
                f"--tensor-parallel-size {tp.size} is larger than the model's {num_kv_heads} KV "
                f"heads and not a multiple of them; use a size that divides or is a multiple of "
                f"{num_kv_heads}"
            )
        local_kv = 1
        kv_start = tp.rank * num_kv_heads // tp.size
    return AttentionShard(local_heads, local_kv, tp.rank * local_heads, kv_start)


def vocab_range(vocab_size: int, tp: TensorParallel) -> Range:
    """Rank r's rows of the embedding and the LM head: ceil(V / tp) per rank (the last rank's
    slice may run past V: those rows are padding, zero, and their logits are cut off)."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank
