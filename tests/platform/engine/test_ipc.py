"""The engine-core IPC messages: what crosses the process boundary comes back the same."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from loraplex.adapters.adapter_names import key_from_digest
from loraplex.adapters.errors import AdapterLoadError
from loraplex.grammar.errors import GrammarTimeoutError
from loraplex.platform.core.commands import AdapterAdded, AddAdapter, SetTenantWeight
from loraplex.platform.core.errors import (
    PromptTooLongError,
    RequestStalledError,
    TenantLimitExceeded,
)
from loraplex.platform.core.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from loraplex.platform.core.sampling_params import RequestOutputKind, SamplingParams
from loraplex.platform.core.structured_outputs import StructuredOutputs
from loraplex.platform.core.tenant_caps import TenantCaps, TenantReservation
from loraplex.platform.engine.ipc import (
    AddRequest,
    Codec,
    CommandRequest,
    CommandResult,
    CoreBatch,
    error_info,
    rebuild_error,
    refusal,
)


@pytest.fixture
def codec() -> Codec:
    return Codec()


def test_an_output_batch_round_trips_with_logprobs_and_failures(codec):
    output = RequestOutput(
        "r-1", None, [5, 6],
        [CompletionOutput(0, "hé", [7], [{7: Logprob(-0.25, 1, "hé"), 9: Logprob(-2.0, 2, "x")}],
                          -0.25, "error", None)],
        True, num_cached_tokens=16, metrics=RequestMetrics(1.0, 1.5, 1), error="stalled",
        failure=RequestStalledError("no progress for 600 s"), prompt_logprobs=[None],
    )  # fmt: skip
    back = codec.decode_core(codec.encode(CoreBatch(outputs=[output]))).outputs[0]
    assert isinstance(back.failure, RequestStalledError)
    assert str(back.failure) == "no progress for 600 s"
    back.failure = output.failure
    assert back == output


def test_sampling_params_round_trip_with_a_grammar(codec):
    params = SamplingParams(
        temperature=0.7, top_k=5, stop=("\n",), seed=3, max_tokens=9,
        structured_outputs=StructuredOutputs(json={"type": "object"}),
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    message = AddRequest("r", [1, 2], params, None, "t", None, 0.5)
    decoded = codec.decode_client(codec.encode(message))
    assert decoded.params == params
    assert decoded.params.stop == ("\n",) and decoded.params.structured_outputs.kind == "json"


def test_an_add_request_with_params_that_fail_validation_is_refused_not_dropped(codec):
    message = msgspec.to_builtins(AddRequest("r-7", [1, 2], SamplingParams(), None, "t", None, 0))
    message["params"]["temperature"] = 5.0  # out of range: SamplingParams refuses it
    data = codec.encode(message)
    with pytest.raises(msgspec.ValidationError) as error:
        codec.decode_client(data)
    request_id, reason = refusal(data, error.value)
    assert request_id == "r-7"
    assert isinstance(reason, ValueError) and reason.param == "temperature"
    assert refusal(codec.encode(CoreBatch()), error.value) is None


@pytest.mark.parametrize(
    "error",
    [PromptTooLongError("too long", param="prompt"), GrammarTimeoutError("slow schema"),
     AdapterLoadError("bad weights"), RequestStalledError("stalled"), ValueError("plain"),
     TenantLimitExceeded("busy", retry_after_s=7), TenantLimitExceeded("never", param="n")],
)  # fmt: skip
def test_errors_come_back_as_their_own_class_with_their_param(error):
    back = rebuild_error(error_info(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
    assert getattr(back, "retry_after_s", None) == getattr(error, "retry_after_s", None)


def test_a_request_carries_its_tenants_caps_and_its_reservation(codec):
    held = TenantReservation(TenantCaps(max_concurrent_requests=2, tokens_per_minute=None), 1, 40)
    message = AddRequest("r", [1, 2], SamplingParams(), None, "t", None, 0.5, held)
    assert codec.decode_client(codec.encode(message)).reservation == held


def test_an_unknown_error_class_comes_back_as_runtime_error():
    class Strange(Exception):
        pass

    assert type(rebuild_error(error_info(Strange("odd")))) is RuntimeError


def test_commands_and_their_results_travel_by_class_name(codec):
    request = codec.decode_client(codec.encode(codec.command(7, SetTenantWeight("acme", 2.0))))
    assert codec.command_of(request) == SetTenantWeight("acme", 2.0)
    added = AdapterAdded("a", key_from_digest("0" * 64), False)
    for value in (added, True, None):
        batch = codec.decode_core(codec.encode(CoreBatch(results=[codec.result(7, value)])))
        assert codec.result_of(batch.results[0]) == value
    failed = CommandResult(8, error=error_info(ValueError("LoRA adapters are disabled")))
    with pytest.raises(ValueError, match="disabled"):
        codec.result_of(codec.decode_core(codec.encode(CoreBatch(results=[failed]))).results[0])


def test_only_engine_commands_are_accepted(codec):
    with pytest.raises(TypeError):
        codec.command(1, SamplingParams())
    bogus = CommandRequest(1, "AdapterAdded", msgspec.Raw(codec.encode(AddAdapter("a", "/p"))))
    with pytest.raises(ValueError, match="unknown engine command"):
        codec.command_of(bogus)


def test_nothing_is_unpickled(codec):
    with pytest.raises(msgspec.DecodeError):
        codec.decode_client(pickle.dumps(AddAdapter("a", "/p")))
