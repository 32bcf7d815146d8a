"""A reader that fell behind receives the deltas waiting for it as one output, in order, with
nothing lost: text, token ids, logprobs, the finish, and an error after them."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.platform.core.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.platform.core.sampling_params import RequestOutputKind
from loraplex.platform.engine.request_stream import RequestStream


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _delta(i: int, finish: str | None = None, prompt_logprobs=None) -> RequestOutput:
    sample = CompletionOutput(
        index=0,
        text=f"t{i} ",
        token_ids=[i],
        logprobs=[{i: Logprob(-0.5 * i, 1, f"t{i} ")}],
        cumulative_logprob=-float(i),
        finish_reason=finish,
    )
    return RequestOutput(
        "r", None, [1, 2], [sample], finish is not None, prompt_logprobs=prompt_logprobs
    )


async def _read_all(queue_items: list[object]) -> tuple[list[RequestOutput], BaseException | None]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in queue_items:
        queue.put_nowait(item)
    stream = RequestStream(_Engine(), "r", queue)  # type: ignore[arg-type]
    outputs = []
    try:
        async for output in stream:
            outputs.append(output)
    except RuntimeError as error:
        return outputs, error
    return outputs, None


def test_waiting_deltas_arrive_as_one_output_with_nothing_lost() -> None:
    items = [_delta(1, prompt_logprobs=[None]), _delta(2), _delta(3, finish="length")]
    outputs, error = asyncio.run(_read_all(items))
    assert error is None
    assert len(outputs) == 1
    (merged,) = outputs
    sample = merged.outputs[0]
    assert sample.text == "t1 t2 t3 "
    assert sample.token_ids == [1, 2, 3]
    assert [list(entry) for entry in sample.logprobs] == [[1], [2], [3]]
    assert sample.cumulative_logprob == -3.0
    assert sample.finish_reason == "length" and merged.finished
    assert merged.prompt_logprobs == [None]  # the first delta's, kept


def test_an_error_after_waiting_deltas_comes_after_them() -> None:
    outputs, error = asyncio.run(_read_all([_delta(1), _delta(2), RuntimeError("engine died")]))
    assert [o.outputs[0].token_ids for o in outputs] == [[1, 2]]
    assert str(error) == "engine died"


def test_a_reader_that_keeps_up_gets_every_delta_alone() -> None:
    async def run() -> list[list[int]]:
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(_Engine(), "r", queue)  # type: ignore[arg-type]
        seen = []
        for i in (1, 2):
            queue.put_nowait(_delta(i, finish="stop" if i == 2 else None))
            seen.append((await anext(stream)).outputs[0].token_ids)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return seen

    assert asyncio.run(run()) == [[1], [2]]


def test_a_reader_of_cumulative_outputs_that_fell_behind_gets_the_latest_whole_text() -> None:
    # NOTE: a cumulative output holds everything before it: merged like deltas, the text of a
    # lagging reader came out repeated ("t1 t1 t2 ...").
    def whole(i: int, finish: str | None = None) -> RequestOutput:
        text = "".join(f"t{j} " for j in range(1, i + 1))
        sample = CompletionOutput(0, text, list(range(1, i + 1)), None, None, finish)
        return RequestOutput("r", None, [1, 2], [sample], finish is not None)

    async def read() -> list[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        for item in (whole(1), whole(2), whole(3, finish="length")):
            queue.put_nowait(item)
        stream = RequestStream(_Engine(), "r", queue, RequestOutputKind.CUMULATIVE)  # type: ignore[arg-type]
        return [output async for output in stream]

    outputs = asyncio.run(read())
    assert len(outputs) == 1
    (last,) = outputs
    assert last.finished
    assert last.outputs[0].text == "t1 t2 t3 "
    assert last.outputs[0].token_ids == [1, 2, 3]
