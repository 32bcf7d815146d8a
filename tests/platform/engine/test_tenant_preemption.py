"""Issue 38's attack on the embedded model: while bob streams, alice sends two batches of
prompts x n samples into a KV pool that holds a fraction of them. Bob's worst gap between
tokens, counted in engine steps, stays within 3x his gap alone; every one of alice's samples
finishes; preemption and recomputation change no token of either (greedy)."""

from __future__ import annotations

import pytest
from engine_configs import cpu_engine_config

from loraplex import SamplingParams
from loraplex.platform.engine.engine import Engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the city begins with",
    "A recipe for bread needs",
    "The planets of the solar system are",
]
BOB_PROMPT = "Write a short story about a lighthouse keeper."
BOB_TOKENS = 24
ALICE_N = 4
ALICE_TOKENS = 16
NUM_KV_BLOCKS = 10  # 160 token slots: a third of what alice's 24 samples grow to


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = Engine(cpu_engine_config(model_dir, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=128))
    yield engine
    engine.shutdown()


def _bob(engine: Engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=BOB_TOKENS, ignore_eos=True)
    engine.add_request("bob", BOB_PROMPT, params, tenant="bob")


def _alice(engine: Engine) -> None:
    params = SamplingParams(n=ALICE_N, temperature=0, max_tokens=ALICE_TOKENS, ignore_eos=True)
    for batch in range(2):
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"alice-{batch}-{i}", f"{prompt} ({batch})", params, tenant="alice")


def _run(engine: Engine, bob_at: int | None, alice_at: int | None) -> tuple[dict, list[int]]:
    """Bob's stream from step `bob_at`, alice's batches from step `alice_at` (None: not sent);
    step until every request finished. Returns ({request id: [(finish reason, token ids)]
    per sample}, the steps that gave bob's tokens, counted from his arrival's step as 1)."""
    finished: dict[str, list[tuple[str | None, list[int]]]] = {}
    bob_steps: list[int] = []
    step = 0
    while engine.has_unfinished_requests() or step < max(bob_at or 0, alice_at or 0):
        step += 1
        assert step < 2000, "the requests did not finish"
        if step == bob_at:
            _bob(engine)
        if step == alice_at:
            _alice(engine)
        for out in engine.step():
            if out.request_id == "bob":
                new = len(out.outputs[0].token_ids) - len(bob_steps)
                bob_steps += [step - bob_at + 1] * new
            if out.finished:
                finished[out.request_id] = [(o.finish_reason, o.token_ids) for o in out.outputs]
    return finished, bob_steps


@pytest.fixture(scope="module")
def alone(engine):
    """Bob's run alone and alice's alone: (alice's samples, bob's samples, bob's steps)."""
    alice, _ = _run(engine, bob_at=None, alice_at=1)
    bob, steps = _run(engine, bob_at=1, alice_at=None)
    return alice, bob["bob"], steps


def _worst_gap(steps: list[int]) -> int:
    return max(b - a for a, b in zip(steps, steps[1:]))


@pytest.mark.parametrize(
    ("bob_at", "alice_at"), [(1, 4), (8, 1)], ids=["bob-streams-first", "bob-joins"]
)
def test_a_tenants_batches_do_not_stall_anothers_stream(engine, alone, bob_at, alice_at):
    alone_alice, alone_bob, alone_steps = alone
    preemptions = engine.stats().num_preemptions
    together, steps = _run(engine, bob_at, alice_at)
    assert engine.stats().num_preemptions > preemptions  # the pool was short
    assert len(steps) == BOB_TOKENS
    # Counted in steps from his arrival: his first token, and the worst gap after it.
    assert steps[0] <= 3 * alone_steps[0], (steps, alone_steps)
    assert _worst_gap(steps) <= 3 * _worst_gap(alone_steps), (steps, alone_steps)
    assert together["bob"] == alone_bob
    for req_id, samples in alone_alice.items():
        assert together[req_id] == samples, req_id
        assert [reason for reason, _ in samples] == ["length"] * ALICE_N
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
