"""Which W4A16 / W8A16 launch runs for M tokens of an [N, K] weight: the one place dispatch on M
lives.

`TUNED_CONFIGS` holds the H200 sweep's winner per (bits, M bucket, N, K), pasted from
`python -m benchmarks.quant_gemm` (or read from the selection table file it writes). Shapes
without an entry take `heuristic_config`, built from the kinds the same sweep chose. A
selection table file overrides entries at run time (`use_selection_table(path)`, which the
quantized linear layers call with LORAPLEX_QUANT_GEMM_TABLE), so one GPU session can sweep and
then serve with its winners.
"""

from __future__ import annotations

import json
from dataclasses import astuple
from pathlib import Path

from loraplex.kernels.w4a16.types import W4A16Config

#: Token counts the tuned table is keyed by; M uses the smallest bucket >= M.
M_BUCKETS = (1, 4, 16, 64, 128, 256, 1024, 4096)

#: (bits, M bucket, N, K) -> measured best launch (H200, group size 128; split_k 0: fitted at
#: run time), the selection table of `python -m benchmarks.quant_gemm --no-fp8` at 170fdb7
#: (benchmarks/results/h200_w4a16_table.json).
TUNED_CONFIGS: dict[tuple[int, int, int, int], W4A16Config] = {
    (4, 1, 4096, 4096): W4A16Config("mma", 16, 128, 8, 4, 3, prefetch=True),
    (4, 1, 4096, 14336): W4A16Config("mma", 16, 128, 16, 4, 3, prefetch=True),
    (4, 1, 6144, 4096): W4A16Config("mma", 16, 128, 8, 4, 3, prefetch=True),
    (4, 1, 28672, 4096): W4A16Config("mma", 16, 128, 2, 4, 3, prefetch=True),
    (4, 4, 4096, 4096): W4A16Config("mma", 16, 128, 8, 4, 3, prefetch=True),
    (4, 4, 4096, 14336): W4A16Config("mma", 16, 128, 16, 4, 3, prefetch=True),
    (4, 4, 6144, 4096): W4A16Config("mma", 16, 128, 8, 4, 3, prefetch=True),
    (4, 4, 28672, 4096): W4A16Config("mma", 16, 128, 2, 4, 3, prefetch=True),
    (4, 16, 4096, 4096): W4A16Config("mma", 16, 128, 8, 4, 3, prefetch=True),
    (4, 16, 4096, 14336): W4A16Config("mma", 16, 128, 16, 4, 3, prefetch=True),
    (4, 16, 6144, 4096): W4A16Config("mma", 16, 128, 8, 4, 3, prefetch=True),
    (4, 16, 28672, 4096): W4A16Config("mma", 16, 128, 2, 4, 3, prefetch=True),
    (4, 64, 4096, 4096): W4A16Config("mma", 64, 128, 4, 4, 3, prefetch=True),
    (4, 64, 4096, 14336): W4A16Config("mma", 64, 256, 8, 8, 3, prefetch=True),
    (4, 64, 6144, 4096): W4A16Config("mma", 64, 128, 4, 4, 3, prefetch=True),
    (4, 64, 28672, 4096): W4A16Config("mma", 64, 128, 1, 4, 3, prefetch=True),
    (4, 128, 4096, 4096): W4A16Config("dequant", 16, 128, 1, 8, 1),
    (4, 128, 4096, 14336): W4A16Config("mma_wscale", 128, 128, 4, 8, 3, prefetch=True),
    (4, 128, 6144, 4096): W4A16Config("dequant", 16, 64, 1, 4, 1),
    (4, 128, 28672, 4096): W4A16Config("mma_wscale", 128, 64, 1, 4, 3, prefetch=True),
    (4, 256, 4096, 4096): W4A16Config("dequant", 16, 128, 1, 8, 1),
    (4, 256, 4096, 14336): W4A16Config("mma_wscale", 256, 128, 4, 8, 3, prefetch=True),
    (4, 256, 6144, 4096): W4A16Config("dequant", 16, 128, 1, 8, 1),
    (4, 256, 28672, 4096): W4A16Config("mma_wscale", 256, 128, 1, 8, 3, prefetch=True),
    (4, 1024, 4096, 4096): W4A16Config("dequant", 16, 128, 1, 8, 1),
    (4, 1024, 4096, 14336): W4A16Config("dequant", 16, 64, 1, 4, 1),
    (4, 1024, 6144, 4096): W4A16Config("dequant", 16, 64, 1, 4, 1),
    (4, 1024, 28672, 4096): W4A16Config("dequant", 16, 64, 1, 4, 1),
    (4, 4096, 4096, 4096): W4A16Config("dequant", 16, 64, 1, 4, 1),
    (4, 4096, 4096, 14336): W4A16Config("dequant", 16, 128, 1, 8, 1),
    (4, 4096, 6144, 4096): W4A16Config("dequant", 16, 128, 1, 8, 1),
    (4, 4096, 28672, 4096): W4A16Config("dequant", 16, 64, 1, 4, 1),
}

_TABLE: dict[tuple[int, int, int, int], W4A16Config] = {}
_TABLE_PATH: list[Path] = []


def m_bucket(m: int) -> int:
    """The smallest tuned token count >= m (the largest bucket beyond it)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def heuristic_config(m: int) -> W4A16Config:
    """Untuned defaults by token count: per bucket, the launch the H200 sweep chose most often
    (dequant + cuBLAS won 11 of the 12 points from 256 tokens on, 2 of 4 at 128)."""
    if m <= 16:
        return W4A16Config("mma", 16, 128, 0, 4, 3)
    if m <= 64:
        return W4A16Config("mma", 64, 256, 0, 8, 3)
    if m <= 128:
        return W4A16Config("mma_wscale", 128, 128, 0, 8, 3)
    return W4A16Config("dequant", 16, 64, 1, 4, 1)


def select_config(m: int, n: int, k: int, bits: int) -> W4A16Config:
    """The launch for M tokens: the table file's entry, the tuned one, or the heuristic."""
    key = (bits, m_bucket(m), n, k)
    return _TABLE.get(key) or TUNED_CONFIGS.get(key) or heuristic_config(m)


def write_selection_table(
    path: Path, table: dict[tuple[int, int, int, int], W4A16Config], about: dict | None = None
) -> None:
    """Write (bits, M bucket, N, K) -> config as JSON, for `use_selection_table`; `about`: other
    keys written beside (e.g. what run measured it), which reading ignores."""
    entries = [
        {"bits": b, "m_bucket": m, "n": n, "k": k, "config": list(astuple(c))}
        for (b, m, n, k), c in sorted(table.items())
    ]
    path.write_text(json.dumps({**(about or {}), "w4a16": entries}, indent=1) + "\n")


def read_selection_table(path: Path) -> dict[tuple[int, int, int, int], W4A16Config]:
    """The table `write_selection_table` wrote; ValueError naming the file if it is malformed."""
    try:
        entries = json.loads(Path(path).read_text())["w4a16"]
        table = {
            (int(e["bits"]), int(e["m_bucket"]), int(e["n"]), int(e["k"])): W4A16Config(
                str(e["config"][0]),
                *(int(v) for v in e["config"][1:6]),
                *(bool(v) for v in e["config"][6:]),
            )
            for e in entries
        }
    except (OSError, KeyError, TypeError, IndexError, json.JSONDecodeError) as exc:
        raise ValueError(f"bad W4A16 selection table {path}: {exc!r}") from exc
    if any(key[1] not in M_BUCKETS for key in table):
        raise ValueError(f"bad W4A16 selection table {path}: M buckets must be in {M_BUCKETS}")
    return table


def use_selection_table(path: Path | None) -> None:
    """Dispatch from the table file at `path` before TUNED_CONFIGS (None: TUNED_CONFIGS only).
    Reading the same path again is a no-op."""
    if path is None:
        _TABLE.clear()
        _TABLE_PATH.clear()
        return
    if _TABLE_PATH == [Path(path)]:
        return
    table = read_selection_table(path)
    _TABLE.clear()
    _TABLE.update(table)
    _TABLE_PATH[:] = [Path(path)]
