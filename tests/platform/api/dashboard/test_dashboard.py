"""The operator dashboard against a live server on the embedded model: two tenants with an
adapter each (and a third held to a token budget) send traffic; `GET /admin/stats` and the
page in headless Chromium show what they did; without the admin key both answer 401."""

from __future__ import annotations

import os
import re
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
from tenant_helpers import ADMIN_KEY, complete, load_hf_model, make_adapter, start_server, upload

from loraplex.platform.api.dashboard.sessions import COOKIE
from tests.waiting import wait_until

PROMPT = [1, 504, 3458, 314, 260, 1345, 28, 4038, 314]
MAX_TOKENS = 8
ROOT = Path(__file__).resolve().parents[4]
# NOTE: the README's screenshots are refreshed only on request (LORAPLEX_DASHBOARD_SCREENSHOTS=
# benchmarks/results); otherwise they go to a temporary folder, so `make test` leaves the
# tracked images alone.
SCREENSHOTS = Path(
    os.environ.get("LORAPLEX_DASHBOARD_SCREENSHOTS") or tempfile.mkdtemp(prefix="dashboard-")
)
GRAFANA = ROOT / "deploy" / "grafana" / "loraplex.json"


@pytest.fixture(scope="module")
def world(model_dir, tmp_path_factory):
    """A server with tenants alpha and beta (an adapter each, one request each) and gamma,
    whose 40-token budget refuses its third request (429)."""
    base = load_hf_model(model_dir)
    adapters = tmp_path_factory.mktemp("adapters")
    folders = {
        t: make_adapter(base, adapters / t, seed=s) for t, s in (("alpha", 11), ("beta", 12))
    }
    server = start_server(model_dir, tmp_path_factory.mktemp("data"))
    admin = server.client(ADMIN_KEY)
    keys = {}
    for body in ({"name": "alpha", "weight": 2.0}, {"name": "beta"},
                 {"name": "gamma", "tokens_per_minute": 40}):  # fmt: skip
        response = admin.post("/admin/tenants", json=body)
        assert response.status_code == 201, response.text
        keys[body["name"]] = response.json()["api_key"]
    for tenant, folder in folders.items():
        client = server.client(keys[tenant])
        assert upload(client, f"{tenant}-support", folder).status_code == 201
        response = complete(client, f"{tenant}-support", PROMPT, MAX_TOKENS)
        assert response.status_code == 200, response.text
    gamma = server.client(keys["gamma"])
    # NOTE: each request charges its full 17 tokens (ignore_eos), so the third finds 34 used
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    statuses = [gamma.post("/v1/completions", json=body).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]
    world = {"server": server, "keys": keys}
    wait_until(lambda: _sampled(world), 30, "a sample of the counters after the traffic")
    yield world
    server.stop()


def _stats(world) -> dict:
    response = world["server"].client(ADMIN_KEY).get("/admin/stats")
    assert response.status_code == 200, response.text
    return response.json()


def _sampled(world) -> bool:
    """The stats show alpha's and beta's traffic as rates and all of gamma's requests: the
    sampler took a sample after the traffic (a sample is reused for half a period, so one taken
    while gamma's last response was still being counted would show it without its 429), and the
    end-to-end latency of every admitted request (a request's first token can be counted before
    its end, and a TTFT without its end-to-end figure skews the quantiles' order)."""
    doc = _stats(world)
    tenants = {t["name"]: t for t in doc["tenants"]}
    rates = [tenants[n]["generation_tokens_per_s"] for n in ("alpha", "beta") if n in tenants]
    counted = tenants.get("gamma", {}).get("requests_total") == 3
    latency = doc["latency"]
    ended = latency["e2e_s"]["count"] >= latency["ttft_s"]["count"] == 4
    return (
        bool(doc["series"]["points"])
        and len(rates) == 2
        and all(r > 0 for r in rates)
        and counted
        and ended
    )


def test_without_the_admin_key_the_page_and_its_json_answer_401(world):
    server = world["server"]
    for key in (None, "sk-wrong", world["keys"]["alpha"]):
        page = server.client(key).get("/dashboard")
        assert page.status_code == 401
        assert 'name="key"' in page.text and "admin key" in page.text  # the login form
        stats = server.client(key).get("/admin/stats")
        assert stats.status_code == 401
        assert stats.json()["error"]["type"] == "authentication_error"
    forged = httpx.Client(base_url=server.base_url, cookies={COOKIE: "9999999999.00"})
    assert forged.get("/dashboard").status_code == 401
    assert forged.get("/admin/stats").status_code == 401
    wrong = server.client(None).post("/dashboard/login", data={"key": "sk-wrong"})
    assert wrong.status_code == 401 and "not the admin key" in wrong.text
    assert server.client(ADMIN_KEY).get("/dashboard").status_code == 200


def test_login_cookie_opens_the_page_and_stats_but_no_other_admin_route(world):
    server = world["server"]
    with httpx.Client(base_url=server.base_url) as browser:
        response = browser.post("/dashboard/login", data={"key": ADMIN_KEY})
        assert response.status_code == 303 and response.headers["location"] == "/dashboard"
        cookie = response.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert browser.get("/dashboard").status_code == 200
        assert browser.get("/admin/stats").json()["object"] == "loraplex.stats"
        assert browser.get("/admin/tenants").status_code == 401
        assert browser.post("/admin/tenants", json={"name": "mallory"}).status_code == 401
        assert browser.get("/dashboard/static/dashboard.js").status_code == 200
        assert browser.get("/dashboard/static/index.html").status_code == 404
        browser.post("/dashboard/logout")
        assert browser.get("/admin/stats").status_code == 401


def test_a_logged_out_session_cookie_is_refused(world):
    """The cookie a logout drops stays refused when a client keeps and sends it again."""
    server = world["server"]
    login = httpx.post(f"{server.base_url}/dashboard/login", data={"key": ADMIN_KEY})
    token = login.cookies[COOKIE]
    kept = httpx.Client(base_url=server.base_url, cookies={COOKIE: token})
    assert kept.get("/admin/stats").status_code == 200
    assert kept.post("/dashboard/logout").status_code == 303
    stolen = httpx.Client(base_url=server.base_url, cookies={COOKIE: token})
    assert stolen.get("/admin/stats").status_code == 401
    assert stolen.get("/dashboard").status_code == 401


def test_a_login_form_with_too_many_fields_answers_400(world):
    server = world["server"]
    fields = {"key": ADMIN_KEY, **{f"f{i}": "x" for i in range(4)}}  # five fields
    response = httpx.post(f"{server.base_url}/dashboard/login", data=fields)
    assert response.status_code == 400 and "too many fields" in response.text
    assert "set-cookie" not in response.headers


def test_stats_show_each_tenant_its_adapter_and_the_engine(world):
    doc = _stats(world)
    tenants = {t["name"]: t for t in doc["tenants"]}
    for name in ("alpha", "beta"):
        t = tenants[name]
        assert t["requests_total"] == 1 and t["errors_total"] == 0
        assert t["prompt_tokens_total"] == len(PROMPT)
        assert 0 < t["generation_tokens_total"] <= MAX_TOKENS
        assert t["generation_tokens_per_s"] > 0
    assert tenants["gamma"]["rate_limited_total"] == 1
    assert tenants["gamma"]["requests_total"] == 3
    # alpha weighs 2, beta and gamma 1 each: all three sent traffic in the last minute
    assert tenants["alpha"]["fair_share"] == pytest.approx(0.5)
    assert tenants["beta"]["fair_share"] == pytest.approx(0.25)
    assert sum(t["use_share"] for t in doc["tenants"]) == pytest.approx(1.0)
    adapters = {(a["tenant"], a["name"]): a for a in doc["adapters"]["items"]}
    for tenant in ("alpha", "beta"):
        adapter = adapters[(tenant, f"{tenant}-support")]
        assert adapter["residency"] == "gpu"
        assert adapter["requests_total"] == 1
    assert doc["adapters"]["pool"]["gpu_slots_used"] == 2
    engine = doc["engine"]
    assert engine["num_kv_blocks_total"] == 512
    assert engine["generation_tokens_total"] >= 4  # alpha, beta, gamma's two
    assert engine["step_time_ms"] > 0
    assert len(doc["series"]["points"]) >= 1
    latency = doc["latency"]
    assert latency["ttft_s"]["count"] == 4  # alpha, beta, and gamma's two admitted requests
    assert 0 < latency["ttft_s"]["p50"] <= latency["ttft_s"]["p95"] <= latency["e2e_s"]["p95"]
    assert latency["itl_s"]["count"] > 0


def _grafana_series(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    names = set()
    for expr in exprs:
        for name in re.findall(r"loraplex:[a-z0-9_]+", expr):
            names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def test_grafana_dashboard_queries_only_series_the_server_exports(world):
    import json

    dashboard = json.loads(GRAFANA.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    used = _grafana_series(dashboard)
    # NOTE: the admin key opens the per-tenant series Grafana charts (tenant names are private)
    text = world["server"].client(ADMIN_KEY).get("/metrics").text
    exported = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))
    assert used and used <= exported, sorted(used - exported)
    assert {"loraplex:kv_cache_usage_perc", "loraplex:tenant_generation_tokens_total",
            "loraplex:lora_adapters_resident", "loraplex:engine_step_seconds_total"} <= used  # fmt: skip


# -- the page in a real browser -------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (make test installs them "
            "with apt-get where it runs as root)"
        )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--disable-gpu", "--window-size=1366,900"):  # fmt: skip
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def _rows(driver, table: str) -> list[list[str]]:
    """The cells' text as shown, read in one go (the page redraws its tables every poll)."""
    script = (
        "return [...document.querySelectorAll(arguments[0])]"
        ".map((row) => [...row.cells].map((cell) => cell.innerText.trim()))"
    )
    return driver.execute_script(script, f"#{table} tbody tr")


def _long_request(world, tenant: str, stop: threading.Event) -> threading.Thread:
    """A streamed request that holds KV blocks until `stop` is set (then it disconnects, and
    the server aborts it)."""
    client = world["server"].client(world["keys"][tenant])
    body = {"model": f"{tenant}-support", "prompt": PROMPT * 4, "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip

    def run() -> None:
        try:
            with client.stream("POST", "/v1/completions", json=body) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break
        except httpx.HTTPError:
            pass  # NOTE: the test reads the page, not this answer

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_dashboard_in_headless_chromium(world):
    from selenium.webdriver.common.by import By

    driver = _browser()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        driver.get(f"{world['server'].base_url}/dashboard")
        driver.find_element(By.ID, "key").send_keys(ADMIN_KEY)
        driver.find_element(By.ID, "login").click()

        def tenant_rows() -> dict[str, list[str]] | None:
            rows = {r[0]: r for r in _rows(driver, "tenants") if len(r) == 9}
            return rows if {"alpha", "beta", "gamma"} <= rows.keys() else None

        tenants = wait_until(tenant_rows, 60, "the tenants table")
        for name in ("alpha", "beta"):
            tokens = int(tenants[name][5].replace(",", ""))
            assert tokens > len(PROMPT), tenants[name]
            assert float(tenants[name][4]) > 0  # generated tok/s over the last minute
        assert tenants["gamma"][7] == "1"  # rate-limited
        assert re.fullmatch(r"[\d.,]+ m?s / [\d.,]+ m?s", driver.find_element(By.ID, "ttft").text)
        adapters = {(r[0], r[1]): r for r in _rows(driver, "adapters")}
        for tenant in ("alpha", "beta"):
            assert adapters[(tenant, f"{tenant}-support")][2] == "GPU"
        kv_before = driver.find_element(By.ID, "kv-blocks").text
        assert re.fullmatch(r"[\d,]+ used / [\d,]+ free of 512 blocks", kv_before), kv_before
        threads += [_long_request(world, t, stop) for t in ("alpha", "beta")]
        kv_busy = wait_until(
            lambda: (text := driver.find_element(By.ID, "kv-blocks").text) != kv_before and text,
            60,
            "the KV figure to change",
        )
        assert int(kv_busy.split()[0].replace(",", "")) > int(kv_before.split()[0].replace(",", ""))
        wait_until(
            lambda: driver.find_elements(By.CSS_SELECTOR, "#chart polyline.gen"), 60, "chart"
        )
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1366, height + 200)  # the whole page, browser frame included
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOTS / "dashboard.png"))
        driver.execute_cdp_cmd(
            "Emulation.setEmulatedMedia",
            {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
        )
        background = driver.execute_script("return getComputedStyle(document.body).backgroundColor")
        red, green, blue = (int(v) for v in re.findall(r"\d+", background)[:3])
        assert red + green + blue < 3 * 64, background  # a dark page, not a white one
        driver.save_screenshot(str(SCREENSHOTS / "dashboard-dark.png"))
    finally:
        stop.set()
        driver.quit()
    for thread in threads:
        thread.join(30)


def test_a_server_without_an_admin_key_keeps_the_dashboard_off(server):
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 403 and "no admin key" in page.text
    stats = httpx.get(f"{server.base_url}/admin/stats")
    assert stats.status_code == 403 and stats.json()["error"]["code"] == "admin_disabled"
    login = httpx.post(f"{server.base_url}/dashboard/login", data={"key": "anything"})
    assert login.status_code == 403 and "set-cookie" not in login.headers
