"""Philox noise: the torch reference against Random123's known answers, the Triton kernel
against the reference bit for bit, and noise that depends on (seed, step, token) only."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.sampling.reference import philox4x32_ref, philox_uniform_ref

# Random123's known-answer vectors for philox4x32_10: (counter, key) -> output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]

# The Triton kernels run compiled on a GPU, else in the interpreter (tests/kernels/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXTREME_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0]
EXTREME_STEPS = [0, 1, 2**32 - 1, 2**32, 2**40 + 3, 7]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_reference_matches_random123_known_answers(counter, key, expected) -> None:
    words = [torch.tensor(v, dtype=torch.int64) for v in (*counter, *key)]
    assert tuple(int(x) for x in philox4x32_ref(*words)) == expected


@pytest.mark.parametrize("n,vocab", [(1, 1), (3, 1025), (6, 77), (2, 2049)])
def test_triton_uniforms_equal_reference_bit_for_bit(n: int, vocab: int) -> None:
    from loraplex.kernels.sampling.triton_philox import philox_uniform_triton

    seeds = torch.tensor(EXTREME_SEEDS[:n], dtype=torch.int64, device=DEVICE)
    steps = torch.tensor(EXTREME_STEPS[:n], dtype=torch.int64, device=DEVICE)
    ref = philox_uniform_ref(seeds, steps, vocab)
    out = philox_uniform_triton(seeds, steps, vocab)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_uniforms_are_inside_the_open_interval_and_uniform() -> None:
    u = philox_uniform_ref(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert u.min() > 0 and u.max() < 1  # -log(-log(u)) is finite everywhere
    hist = torch.histc(u, bins=16, min=0.0, max=1.0)
    expected = u.numel() / 16
    assert ((hist - expected) ** 2 / expected).sum() < 50  # chi-square, 15 dof (p ~ 1e-5)


def test_noise_depends_on_seed_step_and_token_only() -> None:
    from loraplex.kernels.sampling.triton_philox import philox_uniform_triton

    seed, step, vocab = 987654321, 5, 300
    alone = philox_uniform_triton(
        torch.tensor([seed], device=DEVICE), torch.tensor([step], device=DEVICE), vocab
    ).cpu()
    gen = torch.Generator().manual_seed(0)
    for n, row in [(2, 1), (7, 0), (7, 6)]:
        seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen)
        steps = torch.randint(0, 100, (n,), generator=gen)
        seeds[row], steps[row] = seed, step
        batch = philox_uniform_triton(seeds.to(DEVICE), steps.to(DEVICE), vocab).cpu()
        assert torch.equal(batch[row], alone[0])
    # Another step, seed or token gives other noise.
    other_step = philox_uniform_ref(torch.tensor([seed]), torch.tensor([step + 1]), vocab)
    other_seed = philox_uniform_ref(torch.tensor([seed + 1]), torch.tensor([step]), vocab)
    assert (other_step != alone).float().mean() > 0.99
    assert (other_seed != alone).float().mean() > 0.99
    assert alone.unique().numel() > 295
