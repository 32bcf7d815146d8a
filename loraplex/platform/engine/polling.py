"""What the engine looks at before each step, besides the batch: grammars that compiled or failed
(their requests start, or end with the reason) and adapter loads that failed (their requests end
with the reason; every other request carries on). When nothing can run until one of them is
ready, each waits a little for it instead of spinning empty steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.adapters.errors import AdapterLoadError
from loraplex.platform.core.outputs import RequestOutput

if TYPE_CHECKING:
    from loraplex.platform.engine.engine import Engine

WAIT_S = 0.01  # how long an idle engine waits for a compile or a load before it steps


def poll_grammars(engine: Engine) -> list[RequestOutput]:
    """Start requests whose grammar compiled; end those whose compile failed."""
    structured, scheduler = engine.structured, engine.scheduler
    if (
        structured.num_waiting
        and not scheduler.num_running
        and not engine.has_step_in_flight
        and scheduler.num_waiting == structured.num_waiting
    ):
        # NOTE: every request waits for its grammar: wait for the compile threads.
        structured.wait(WAIT_S)
    outputs = []
    for request, error in structured.poll():
        parent_id = engine.output_processor.parent_of(request.request_id)
        if parent_id is None:
            continue
        out = engine.abort_request(parent_id)
        if out is not None:
            out.error = str(error)
            out.failure = error
            outputs.append(out)
    return outputs


def poll_adapters(engine: Engine) -> list[RequestOutput]:
    """End, with the reason, the requests on adapters that failed to load since the last
    step."""
    manager, scheduler = engine.lora_manager, engine.scheduler
    if manager is None:
        return []
    if not scheduler.num_running and not engine.has_step_in_flight and scheduler.num_waiting:
        # NOTE: nothing runs and requests wait (maybe for an adapter being read): wait for
        # the loader.
        manager.wait_for_loads(WAIT_S)
    manager.poll()
    failures = manager.take_failures()
    if not failures:
        return []
    reasons: dict[str, str] = {}  # parent request id -> why
    for request in scheduler.requests.values():
        if request.adapter_key is None:
            continue
        reason = failures.get(request.adapter_key)
        parent_id = engine.output_processor.parent_of(request.request_id)
        if reason is not None and parent_id is not None:
            reasons.setdefault(parent_id, reason)
    outputs = []
    for parent_id, reason in reasons.items():
        out = engine.abort_request(parent_id, error=AdapterLoadError(reason))
        if out is not None:
            outputs.append(out)
    return outputs
