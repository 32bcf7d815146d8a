"""Schemathesis fuzzes the live API from its own /openapi.json: no request, valid or not, may
answer 5xx or hang, and the server is healthy and idle afterwards. Besides schemathesis' own
valid and invalid bodies, a hostile pass puts what attackers send into one field of each
generated body (or path): integers of thousands of digits, NaN-like and overflowing numbers,
lone surrogates, control characters, very long strings. The dashboard's login and logout forms
(not in the schema) get random form fields, raw bytes and cookies. Afterwards /metrics still
parses with Prometheus' own parser. A planted crashing route shows the fuzzer would catch a 5xx.

`make test` runs a bounded pass (LORAPLEX_FUZZ_EXAMPLES examples per operation, default 10);
`make fuzz` runs a long one.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import httpx
import pytest
from api_helpers import wait_until_idle
from tenant_helpers import ADMIN_KEY, start_server

from loraplex.grammar.config import GrammarConfig

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
text_string_to_metric_families = pytest.importorskip(
    "prometheus_client.parser", reason="prometheus-client is in the dev extra"
).text_string_to_metric_families
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis comes with schemathesis")

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "10"))
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 2  # generation stays short: every generated body is clamped to this
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
MAX_BODY_BYTES = 64 * 1024  # the fuzz server's --max-request-body-bytes
# What an attacker puts in a field: raw JSON values (numbers Python cannot convert or a float
# cannot hold, escapes of lone surrogates, deep nesting, a string over the body limit) and
# strings (control characters, line and paragraph separators, markup, long text).
HOSTILE_JSON = (
    "9" * 5000, "-" + "9" * 5000, "1" + "0" * 4400 + ".5", "1e400", '"\\ud800"', '"a\\udfff"',
    "[" * 64 + "]" * 64, '"' + "x" * (MAX_BODY_BYTES + 10) + '"',
)  # fmt: skip
HOSTILE_TEXT = (
    "x\n", "\r\n\x00\x1b[31m\x7f", "\u2028\u2029\x85", '"\\\'</script>{{7*7}}',
    "\ud7ff\ue000\uffff\U0010ffff", "x" * 20_000, "%0A%00%", "../../etc/passwd", "é" * 5000,
)  # fmt: skip
_SLOT = "__loraplex_fuzz_slot__"


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


def _leaf_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a JSON value a hostile value can go: each leaf, and a new key of each
    object."""
    if isinstance(value, dict):
        return [(*path, _SLOT), *(p for k, v in value.items() for p in _leaf_paths(v, (*path, k)))]
    if isinstance(value, list) and value:
        return [p for i, v in enumerate(value) for p in _leaf_paths(v, (*path, i))]
    return [path]


def _with_slot(value: Any, path: tuple) -> Any:
    """`value` with the place at `path` holding the slot marker."""
    if not path:
        return _SLOT
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _with_slot(value.get(head), rest)}
    copy = list(value)
    copy[head] = _with_slot(copy[head], rest)
    return copy


def _hostile_json(body: Any, where: int, raw: str) -> bytes:
    """`body` as JSON text with the raw JSON value `raw` at one of its places."""
    places = _leaf_paths(body)
    marked = json.dumps(_with_slot(body, places[where % len(places)]))
    return marked.replace(json.dumps(_SLOT), raw, 1).encode("utf-8", "surrogatepass")


def _hostile_pass(base_url: str, tenant_key: str) -> Counter:
    """One hostile value in one place of each generated case: a JSON body's field (raw
    text, so numbers Python cannot print go in too), a multipart body's fields, or a path
    parameter. AssertionError on a 5xx."""
    import httpx
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    answered: Counter = Counter()
    values = st.sampled_from([("json", v) for v in HOSTILE_JSON] + [("text", v) for v in
                                                                    HOSTILE_TEXT])  # fmt: skip
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy(), where=st.integers(0, 10**6), hostile=values)
        def check(case, where: int, hostile: tuple[str, str]) -> None:
            _bound(case)
            kind, value = hostile
            text = value if kind == "text" else "9" * 5000
            headers = _headers(case.path, tenant_key)
            if case.path_parameters:
                case.path_parameters = {name: text for name in case.path_parameters}
            if case.media_type == "application/json":
                raw = value if kind == "json" else json.dumps(text)
                response = httpx.request(
                    case.method, f"{base_url}{case.formatted_path}", params=case.query,
                    content=_hostile_json(case.body, where, raw), timeout=REQUEST_TIMEOUT_S,
                    headers={**headers, "Content-Type": "application/json"},
                )  # fmt: skip
            else:
                if isinstance(case.body, dict):
                    case.body = {k: text if isinstance(v, str) else v for k, v in case.body.items()}
                response = case.call(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT_S)
            answered[f"{case.method} {case.path}", response.status_code] += 1
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} with {value[:40]!r} answered "
                f"{response.status_code}: {response.text[:300]}"
            )

        check()
    return answered


def test_the_fuzzed_api_never_answers_5xx_and_stays_healthy(fuzz_server):
    server, key = fuzz_server
    answered = _fuzz(server.base_url, key)
    hostile = _hostile_pass(server.base_url, key)
    assert {route for route, _ in hostile} == {route for route, _ in answered}
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /admin/tenants",
                  "POST /tokenize", "POST /detokenize", "POST /v1/responses"):  # fmt: skip
        assert hostile[route, 400], route  # the hostile values were refused, not served
    assert len({route for route, _ in answered}) >= 10  # every route of the API was fuzzed
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        # Both valid requests (generating) and refused ones came through.
        assert answered[route, 200] and answered[route, 400], route
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    metrics = wait_until_idle(server.base_url)
    assert metrics["loraplex:num_requests_running"] == 0
    assert metrics["loraplex:num_requests_waiting"] == 0
    assert metrics["loraplex:num_kv_blocks_free"] == metrics["loraplex:num_kv_blocks_total"]
    # The tenant still generates, and every name the fuzzer managed to store leaves /metrics
    # parseable.
    body = {"prompt": "Hi", "max_tokens": 2}
    assert server.client(key).post("/v1/completions", json=body).status_code == 200
    text = server.client(ADMIN_KEY).get("/metrics").text
    assert list(text_string_to_metric_families(text))


def test_the_dashboard_forms_and_cookies_never_answer_5xx(fuzz_server):
    """The login and logout forms (outside the schema) with random fields, raw bytes, and
    random cookies on the page and its JSON."""
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    server, _ = fuzz_server
    text = st.text(max_size=300) | st.sampled_from(HOSTILE_TEXT)
    fields = st.lists(st.tuples(st.sampled_from(["key", "k", "", "key[]"]) | text, text),
                      max_size=8)  # fmt: skip
    # NOTE: what a header may carry (HTTP forbids control characters there)
    cookie = st.text(st.characters(min_codepoint=32, max_codepoint=255, blacklist_characters="\x7f"),
                     max_size=200)  # fmt: skip
    answered: Counter = Counter()

    @settings(max_examples=EXAMPLES * 4, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(form=fields, raw=st.binary(max_size=6000), jar=cookie)
    def check(form, raw: bytes, jar: str) -> None:
        session = b"loraplex_dashboard=" + jar.encode("latin-1")
        with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as client:
            responses = [
                client.post("/dashboard/login", data=dict(form)),
                client.post("/dashboard/login", content=raw,
                            headers={"Content-Type": "application/x-www-form-urlencoded"}),
                client.post("/dashboard/logout", headers={"Cookie": session}),
                client.get("/dashboard", headers={"Cookie": jar.encode("latin-1")}),
                client.get("/admin/stats", headers={"Cookie": session}),
            ]  # fmt: skip
        for response in responses:
            answered[response.request.url.path, response.status_code] += 1
            assert response.status_code < 500, (response.request.url, response.text[:300])

    check()
    assert answered["/dashboard/login", 401] and answered["/admin/stats", 401]


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
