"""The benchmarks' sampling mixes: what each request of a mix asks for."""

from __future__ import annotations

import pytest

from benchmarks.common.sampling_mixes import GREEDY_T1, MIXED, MIXES, mix_fields


def test_greedy_t1_alternates_greedy_and_temperature_one() -> None:
    fields = [mix_fields(GREEDY_T1, i) for i in range(4)]
    assert [f["temperature"] for f in fields] == [0.0, 1.0, 0.0, 1.0]
    assert fields[1] == MIXES["t1"]


def test_mixed_cycles_every_mix_with_a_seed_per_request() -> None:
    fields = [mix_fields(MIXED, i) for i in range(len(MIXES))]
    assert fields[0] == MIXES["greedy"]
    assert fields[list(MIXES).index("t07_seed")]["seed"] == list(MIXES).index("t07_seed")


def test_an_unknown_mix_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown mix"):
        mix_fields("t2", 0)
