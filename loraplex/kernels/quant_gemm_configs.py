"""Launch configurations of the W4A16 / W8A16 dequant-GEMM, the one place dispatch on M lives.

Nine kernels (see `quant_gemm_w4a16`):
- "gemv": one token row per program, FMA dot products, split-K (decode, M <= 2);
- "fma": like "gemv", with a dequantization of ~2 instructions per weight and no layout change
  or cross-thread reduction in the loop (the bandwidth-bound decode kernel, M of 1 to a few);
- "gemm": tiled tensor-core kernel, dequant in the prologue, split-K when the tiles alone do not
  fill the GPU (M up to a few hundred);
- "gemm_t": "gemm" with the MMA operands swapped (weight tile as the MMA's M side, tokens as
  its N side), for M = 16..64 where a token tile would waste most of a Hopper MMA;
- "sliced" / "sliced_t": the tensor-core kernel of `triton_quant_gemm_sliced`, one dot per
  value position of a word instead of one reshaped tile ("_t": weight on the MMA's M side);
- "stream": the decode tensor-core kernel of `triton_quant_gemm_stream` (weight on the MMA's
  M side, two values per integer op, zero point outside the loop, split-K), M = 1..64;
  "stream_pair": the same with the two values of each masked word adjacent along K;
- "dequant": dequantize `block_n` output columns at a time into a reused buffer (it stays in L2)
  and run the dense matmul on it (prefill, M >= `DEQUANT_MATMUL_MIN_M`).

`TUNED_CONFIGS` holds measured winners per (bits, M bucket, N, K); `python -m benchmarks.quant_gemm`
prints the dict to paste here. Shapes without an entry fall back to `heuristic_config`. A
selection table file (`write_selection_table`, written by the benchmark's sweep) overrides
entries at run time: `use_selection_table(path)`, which the quantized linear layers call with
LORAPLEX_QUANT_GEMM_TABLE, so one GPU session can sweep and then serve with the winners.
"""

from __future__ import annotations

import json
from dataclasses import astuple, dataclass
from pathlib import Path

#: Without a tuned entry, from this many tokens on dequantize and run the dense matmul (on the
#: H200 it beat every fused tensor-core kernel from M = 128 on, 3 shapes of 4).
DEQUANT_MATMUL_MIN_M = 128

#: Token counts the tuned table is keyed by; M uses the smallest bucket >= M.
M_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)

KINDS = (
    "gemv", "fma", "gemm", "gemm_t", "sliced", "sliced_t", "stream", "stream_pair",
    "dequant",
)  # fmt: skip

#: The sliced kernels take one dot per value position; a GPU dot needs a depth of >= 16 words.
SLICED_KINDS = ("sliced", "sliced_t")
SLICED_MIN_WORDS = 16
#: Kinds with one dot per value position, and the reshaping kernel each falls back to on the
#: GPU when a K tile holds fewer than SLICED_MIN_WORDS words.
SHALLOW_FALLBACK = {
    "sliced": "gemm", "sliced_t": "gemm_t", "stream": "gemm_t", "stream_pair": "gemm_t"
}  # fmt: skip


#: Kinds that run one token row per program (block_m must be 1).
ONE_ROW_KINDS = ("gemv", "fma")


@dataclass(frozen=True)
class GemmConfig:
    """One launch: `kind` of kernel, tiles, split-K (0: pick from the SM count), warps, stages.

    For "dequant", `block_n` is the width of one dequantized column chunk (0: all of N)."""

    kind: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ONE_ROW_KINDS and self.block_m != 1:
            raise ValueError(
                f"the {self.kind} kernel runs one row per program, got block_m {self.block_m}"
            )
        if self.num_stages < 1 or self.num_warps < 1:
            raise ValueError(
                f"num_warps and num_stages must be >= 1, got {self.num_warps}, {self.num_stages}"
            )


#: (bits, M bucket, N, K) -> measured best config (H200, group size 128), pasted from
#: `python -m benchmarks.quant_gemm --sweep` (benchmarks/results/h200_quant.json, 9732be6); the
#: M = 1, 4, 16 and 64 rows from the W4A16 decode sweep with the streamed kernels
#: (`--sweep-w4a16`, benchmarks/results/h200_w4a16_table.json, bae7d40).
TUNED_CONFIGS: dict[tuple[int, int, int, int], GemmConfig] = {
    (4, 1, 6144, 4096): GemmConfig("fma", 1, 256, 64, 16, 4, 3),
    (4, 4, 6144, 4096): GemmConfig("stream_pair", 16, 128, 128, 0, 4, 3),
    (4, 16, 6144, 4096): GemmConfig("stream_pair", 16, 128, 128, 0, 4, 3),
    (4, 32, 6144, 4096): GemmConfig("gemm_t", 32, 64, 128, 0, 4, 2),
    (4, 64, 6144, 4096): GemmConfig("gemm_t", 64, 64, 128, 4, 4, 2),
    (4, 128, 6144, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 256, 6144, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 1024, 6144, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 4096, 6144, 4096): GemmConfig("dequant", 0, 2048, 128, 1, 4, 1),
    (4, 1, 4096, 4096): GemmConfig("stream_pair", 16, 128, 128, 0, 2, 1),
    (4, 4, 4096, 4096): GemmConfig("stream_pair", 16, 128, 128, 0, 4, 1),
    (4, 16, 4096, 4096): GemmConfig("stream_pair", 16, 128, 128, 0, 4, 1),
    (4, 32, 4096, 4096): GemmConfig("gemm_t", 32, 64, 128, 0, 4, 2),
    (4, 64, 4096, 4096): GemmConfig("gemm_t", 64, 64, 64, 0, 4, 4),
    (4, 128, 4096, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 256, 4096, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 1024, 4096, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 4096, 4096, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 1, 28672, 4096): GemmConfig("fma", 1, 256, 64, 16, 4, 3),
    (4, 4, 28672, 4096): GemmConfig("stream_pair", 16, 128, 128, 4, 4, 3),
    (4, 16, 28672, 4096): GemmConfig("stream_pair", 16, 128, 128, 4, 4, 3),
    (4, 32, 28672, 4096): GemmConfig("gemm_t", 32, 64, 128, 0, 4, 2),
    (4, 64, 28672, 4096): GemmConfig("gemm", 64, 64, 128, 0, 4, 3),
    (4, 128, 28672, 4096): GemmConfig("gemm", 64, 64, 128, 0, 4, 3),
    (4, 256, 28672, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 1024, 28672, 4096): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 4096, 28672, 4096): GemmConfig("dequant", 0, 1024, 128, 1, 4, 1),
    (4, 1, 4096, 14336): GemmConfig("fma", 1, 64, 128, 0, 2, 3),
    (4, 4, 4096, 14336): GemmConfig("stream_pair", 16, 128, 128, 0, 4, 1),
    (4, 16, 4096, 14336): GemmConfig("stream_pair", 16, 128, 128, 0, 4, 1),
    (4, 32, 4096, 14336): GemmConfig("gemm_t", 32, 64, 128, 0, 4, 2),
    (4, 64, 4096, 14336): GemmConfig("gemm_t", 64, 64, 64, 0, 4, 4),
    (4, 128, 4096, 14336): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 256, 4096, 14336): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 1024, 4096, 14336): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
    (4, 4096, 4096, 14336): GemmConfig("dequant", 0, 0, 128, 1, 4, 1),
}


#: Entries of the selection table file in use (they take precedence over TUNED_CONFIGS).
_TABLE: dict[tuple[int, int, int, int], GemmConfig] = {}
_TABLE_PATH: list[Path] = []


def write_selection_table(
    path: Path, table: dict[tuple[int, int, int, int], GemmConfig], about: dict | None = None
) -> None:
    """Write (bits, M bucket, N, K) -> config as JSON, for `use_selection_table`; `about`: other
    keys written beside (e.g. what run measured it), which reading ignores."""
    entries = [
        {"bits": b, "m_bucket": m, "n": n, "k": k, "config": list(astuple(c))}
        for (b, m, n, k), c in sorted(table.items())
    ]
    path.write_text(json.dumps({**(about or {}), "w4a16": entries}, indent=1) + "\n")


def read_selection_table(path: Path) -> dict[tuple[int, int, int, int], GemmConfig]:
    """The table `write_selection_table` wrote; ValueError naming the file if it is malformed."""
    try:
        entries = json.loads(Path(path).read_text())["w4a16"]
        table = {
            (int(e["bits"]), int(e["m_bucket"]), int(e["n"]), int(e["k"])): GemmConfig(
                str(e["config"][0]), *(int(v) for v in e["config"][1:])
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


def m_bucket(m: int) -> int:
    """The smallest tuned token count >= m (the largest bucket beyond it)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def heuristic_config(m: int) -> GemmConfig:
    """Untuned defaults by token count (the kinds that won each bucket of the H200 sweep)."""
    if m <= 2:
        return GemmConfig("fma", 1, 128, 128, 0, 4, 3)
    if m <= 4:
        return GemmConfig("sliced_t", 16, 128, 128, 0, 4, 3)
    if m <= 16:
        return GemmConfig("gemm", 16, 128, 128, 0, 4, 1)
    if m < DEQUANT_MATMUL_MIN_M:
        return GemmConfig("gemm_t", 32 if m <= 32 else 64, 64, 128, 0, 4, 2)
    return GemmConfig("dequant", 0, 0, 128, 1, 4, 1)


def fit_block_k(block_k: int, group_size: int, k: int, pack: int) -> int:
    """Largest power-of-two <= block_k dividing the group (so a K tile is inside one group),
    at least 16 features and one word of `pack` values."""
    block_k = min(block_k, group_size, k)
    while block_k > 16 and (group_size % block_k or block_k & (block_k - 1)):
        block_k //= 2
    if group_size % block_k or block_k % pack or block_k < 16:
        raise ValueError(f"no K tile fits group_size {group_size} (K={k}, {pack} values a word)")
    return block_k


def fit_split_k(config: GemmConfig, m: int, n: int, k: int, num_sms: int) -> int:
    """Resolve split_k 0 to the split that gives about two programs per SM, keeping every
    split at least one K tile."""
    k_blocks = k // config.block_k
    if config.split_k:
        return max(1, min(config.split_k, k_blocks))
    rows = m if config.kind in ONE_ROW_KINDS else -(-m // config.block_m)
    tiles = rows * -(-n // config.block_n)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= k_blocks:
        split *= 2
    return split


def select_config(m: int, n: int, k: int, group_size: int, bits: int, num_sms: int) -> GemmConfig:
    """The launch for M tokens of an [N, K] weight: the tuned entry or the heuristic, with
    block_k fitted to the group size and split_k resolved."""
    key = (bits, m_bucket(m), n, k)
    config = _TABLE.get(key) or TUNED_CONFIGS.get(key) or heuristic_config(m)
    return resolve(config, m, n, k, group_size, bits, num_sms)


def resolve(
    config: GemmConfig, m: int, n: int, k: int, group_size: int, bits: int, num_sms: int
) -> GemmConfig:
    """Make a config launchable at this shape: fitted block_k, concrete split_k."""
    block_k = fit_block_k(config.block_k, group_size, k, 32 // bits)
    fitted = GemmConfig(
        config.kind, config.block_m, config.block_n, block_k, config.split_k,
        config.num_warps, config.num_stages,
    )  # fmt: skip
    if config.kind == "dequant":
        return fitted
    split = fit_split_k(fitted, m, n, k, num_sms)
    return GemmConfig(
        config.kind, config.block_m, config.block_n, block_k, split,
        config.num_warps, config.num_stages,
    )  # fmt: skip


def without_shallow_slices(config: GemmConfig, bits: int) -> GemmConfig:
    """On the GPU, a sliced or stream config whose K tile holds < 16 words per value position
    (a group too small) runs the reshaping kernel of the same orientation instead."""
    fallback = SHALLOW_FALLBACK.get(config.kind)
    if fallback is None or config.block_k // (32 // bits) >= SLICED_MIN_WORDS:
        return config
    return GemmConfig(
        fallback, config.block_m, config.block_n, config.block_k, config.split_k,
        config.num_warps, config.num_stages,
    )  # fmt: skip
