"""The C Philox of CPU sampling: the reference's uniforms bit for bit, the same seeded draws as
`draw_ref`, and the torch reference where no C compiler works."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from loraplex.kernels import cpu_native
from loraplex.kernels.sampling import cpu_philox, draw
from loraplex.kernels.sampling.reference import draw_ref, philox_uniform_ref

EXTREME_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0, 42]
EXTREME_STEPS = [0, 1, 2**32 - 1, 2**32, 2**40 + 3, 7, 2**63 - 1]


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A host without a working C compiler and nothing built yet."""
    monkeypatch.setenv("CC", "loraplex-no-such-compiler")
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    cpu_native.load_library.cache_clear()
    yield
    cpu_native.load_library.cache_clear()


needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler on this host: sampling keeps the torch Philox "
    "(test_without_a_compiler_the_draw_falls_back_to_torch)",
)


@needs_compiler
def test_the_library_builds_here() -> None:
    assert cpu_philox.load() is not None


@needs_compiler
@pytest.mark.parametrize("n,vocab", [(1, 1), (2, 3), (7, 77), (3, 1025), (7, 4096), (1, 49152)])
def test_uniforms_equal_the_reference_bit_for_bit(n: int, vocab: int) -> None:
    seeds = torch.tensor(EXTREME_SEEDS[:n])
    steps = torch.tensor(EXTREME_STEPS[:n])
    out = cpu_philox.philox_uniform_cpu(seeds, steps, vocab)
    ref = philox_uniform_ref(seeds, steps, vocab)
    assert out is not None and out.shape == (n, vocab) and out.dtype == torch.float32
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@needs_compiler
def test_uniforms_of_a_strided_column_of_seeds() -> None:
    # The persistent batch hands out views of its columns: a non-contiguous view must not be
    # read as if it were contiguous.
    table = torch.tensor([[11, 0], [22, 0], [33, 0]])
    seeds, steps = table[:, 0], table[:, 1] + 5
    out = cpu_philox.philox_uniform_cpu(seeds, steps, 9)
    assert torch.equal(out, philox_uniform_ref(seeds.contiguous(), steps.contiguous(), 9))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="seeds and steps"):
        cpu_philox.philox_uniform_cpu(torch.zeros(2, dtype=torch.int64), torch.zeros(3), 10)
    with pytest.raises(ValueError, match="vocab"):
        cpu_philox.philox_uniform_cpu(torch.zeros(2, dtype=torch.int64), torch.zeros(2), 0)


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("greedy_rows", [(1,), (), (0, 1, 2, 3, 4, 5)])
def test_cpu_draw_matches_the_reference(truncate: bool, greedy_rows: tuple[int, ...]) -> None:
    # The CPU draw makes noise for the sampled rows only: mixed, none greedy and all greedy.
    gen = torch.Generator().manual_seed(7)
    n, vocab = 6, 1000
    logits = torch.randn(n, vocab, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.5, 0.7, 1.5, 1.0, 0.3])
    temperature[list(greedy_rows)] = 0.0
    thresholds = logits.quantile(0.9, dim=-1) if truncate else None
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    steps = torch.randint(0, 1000, (n,), generator=gen)
    tokens = draw(logits, temperature, thresholds, seeds, steps)
    assert torch.equal(tokens, draw_ref(logits, temperature, thresholds, seeds, steps))
    for row in greedy_rows:
        assert tokens[row] == logits[row].argmax()
    if truncate:
        kept = logits.gather(1, tokens[:, None]).squeeze(1) >= thresholds
        assert bool(kept.all())
    assert torch.equal(
        logits, torch.randn(n, vocab, generator=torch.Generator().manual_seed(7)) * 3
    )


def test_without_a_compiler_the_draw_falls_back_to_torch(no_compiler) -> None:
    assert cpu_philox.philox_uniform_cpu(torch.tensor([1]), torch.tensor([2]), 8) is None
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 500, generator=gen)
    temperature = torch.ones(3)
    seeds, steps = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    tokens = draw(logits, temperature, None, seeds, steps)
    assert torch.equal(tokens, draw_ref(logits, temperature, None, seeds, steps))


@needs_compiler
def test_a_build_is_cached_for_the_next_process(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    cpu_native.load_library.cache_clear()
    try:
        assert cpu_philox.load() is not None
        built = list((tmp_path / "cpu_kernels").glob("philox-*.so"))
        assert len(built) == 1
        cpu_native.load_library.cache_clear()
        monkeypatch.setenv("CC", "loraplex-no-such-compiler")  # a cached build needs none
        assert cpu_philox.load() is not None
        out = cpu_philox.philox_uniform_cpu(torch.tensor([3]), torch.tensor([4]), 5)
        assert torch.equal(out, philox_uniform_ref(torch.tensor([3]), torch.tensor([4]), 5))
    finally:
        cpu_native.load_library.cache_clear()
