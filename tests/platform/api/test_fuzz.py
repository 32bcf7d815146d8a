"""Schemathesis fuzzes the live API from its own /openapi.json: no request, valid or not, may
answer 5xx or hang, and the server is healthy and idle afterwards. A planted crashing route
shows the fuzzer would catch a 5xx.

`make test` runs a bounded pass (LORAPLEX_FUZZ_EXAMPLES examples per operation, default 15);
`make fuzz` runs a long one.
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
from api_helpers import wait_until_idle
from tenant_helpers import ADMIN_KEY, start_server

from loraplex.grammar.config import GrammarConfig

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis comes with schemathesis")

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "15"))
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 2  # generation stays short: every generated body is clamped to this
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


@pytest.fixture(scope="module")
def fuzz_server(model_dir, tmp_path_factory):
    """A server with an admin key, one tenant, tight request limits and a short grammar
    compile timeout (random regexes and schemas are cheap to refuse)."""
    server = start_server(
        model_dir,
        tmp_path_factory.mktemp("fuzz-data"),
        grammar=GrammarConfig(compile_timeout_s=5.0, num_workers=1, disk_cache=False),
        max_n=2,
        max_prompts_per_request=3,
        max_request_body_bytes=64 * 1024,
    )
    created = server.client(ADMIN_KEY).post("/admin/tenants", json={"name": "fuzz-tenant-q7"})
    assert created.status_code == 201, created.text
    yield server, created.json()["api_key"]
    server.stop()


def _headers(path: str, tenant_key: str) -> dict[str, str]:
    key = ADMIN_KEY if path.startswith("/admin/") else tenant_key
    return {"Authorization": f"Bearer {key}"}


def _bound(case) -> None:
    """Keep generation short: cap max_tokens (and OpenAI's newer name) of a generation body."""
    if case.path in GENERATION_PATHS and isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value > MAX_TOKENS:
                case.body[key] = MAX_TOKENS


def _fuzz(base_url: str, tenant_key: str, paths: set[str] | None = None) -> Counter:
    """Fuzz every operation (or those under `paths`); AssertionError on a 5xx. Returns how
    often each (method path, status) was answered."""
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    answered: Counter = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        if paths is not None and operation.path not in paths:
            continue
        for mode in modes:
            if mode is schemathesis.GenerationMode.NEGATIVE and not len(operation.body):
                continue  # nothing to break but the path: the positive pass covers it

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case) -> None:
                _bound(case)
                headers = _headers(case.path, tenant_key)
                response = case.call(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT_S)
                answered[f"{case.method} {case.path}", response.status_code] += 1
                assert response.status_code < 500, (
                    f"{case.method} {case.formatted_path} answered {response.status_code}: "
                    f"{response.text[:300]}\n{case.as_curl_command(headers)}"
                )

            check()
    return answered


def test_the_fuzzed_api_never_answers_5xx_and_stays_healthy(fuzz_server):
    server, key = fuzz_server
    answered = _fuzz(server.base_url, key)
    assert len({route for route, _ in answered}) >= 10  # every route of the API was fuzzed
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        # Both valid requests (generating) and refused ones came through.
        assert answered[route, 200] and answered[route, 400], route
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    metrics = wait_until_idle(server.base_url)
    assert metrics["loraplex:num_requests_running"] == 0
    assert metrics["loraplex:num_requests_waiting"] == 0
    assert metrics["loraplex:num_kv_blocks_free"] == metrics["loraplex:num_kv_blocks_total"]
    # The tenant still generates.
    body = {"prompt": "Hi", "max_tokens": 2}
    assert server.client(key).post("/v1/completions", json=body).status_code == 200


def test_the_fuzzer_catches_a_planted_crash(fuzz_server):
    server, key = fuzz_server
    app = server.uvicorn.config.app

    async def crash(depth: int) -> dict:
        if depth >= 0:
            raise RuntimeError("planted crash")
        return {"depth": depth}

    app.add_api_route("/v1/planted-crash", crash, methods=["GET"])
    app.openapi_schema = None
    try:
        with pytest.raises(AssertionError, match="answered 500"):
            _fuzz(server.base_url, key, paths={"/v1/planted-crash"})
    finally:
        app.router.routes.pop()
        app.openapi_schema = None
