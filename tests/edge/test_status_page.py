"""The operator's status page (/status, /status.json): who may see it, what its board keeps, and in a real headless
Chromium against the real server that it renders, agrees with /metrics under load, and shows a tier change
within 3 s. Chromium is driven over the DevTools protocol with aiohttp's websocket client (no extra package)."""

import asyncio
import base64
import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
from types import SimpleNamespace

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fake_engine_link import FakeEngine
from fake_gateway import fake_gateway

from edge.config import ServeConfig
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlightRegistry
from edge.core.metrics import Metrics
from edge.core.request_record import RequestRecord
from edge.http.routes import add_routes
from edge.observe.status_board import SESSION_COOKIE, WINDOW_S, StatusBoard, StatusSessions
from edge.state import GATEWAY
from policies.enforcer import PolicyEnforcer
from policies.schema import ApiKeyRule, Policy, Tier
from server_process import served, wait_for

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ADMIN, USER, BATCH = "admin-key-0123", "user-key-0123", "batch-key-0123"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")  # what `make install` looks for too
CONFIG = """
kv_cache_tokens = 2048
[limits]
shutdown_grace_s = 1.0
"""
POLICY = f"""
version = 1
default_class = "standard"
[classes.ops]
priority = 0
[classes.standard]
priority = 0
[classes.batch]
priority = 10
[[keys]]
key = "{ADMIN}"
class = "ops"
admin = true
[[keys]]
key = "{USER}"
class = "standard"
[[keys]]
key = "{BATCH}"
class = "batch"
"""
# waiting_requests >= 0 always holds and the exit (< -1) never does: the tier is entered at the next tick
FORCED_TIER = POLICY + """
[[tiers]]
name = "forced"
min_dwell_s = 0
enter = { waiting_requests = 0 }
exit = { waiting_requests = -1 }
"""


# --- who may see the page (a real Gateway on fakes: only its policy matters) -------------------------------------

def _app(policy_keys: dict) -> web.Application:
    """policy_keys: the policy's keys, a dict a test may change while the app runs."""
    app = web.Application()
    app[GATEWAY], _ = fake_gateway(Policy("test", keys=policy_keys))
    add_routes(app)
    return app


def _status(policy_keys: dict, path: str, **kwargs):
    async def run():
        async with TestClient(TestServer(_app(policy_keys))) as client:
            response = await client.get(path, **kwargs)
            return response.status, response.headers, await response.text()
    return asyncio.run(run())


KEYS = {ADMIN: ApiKeyRule(ADMIN, "default", admin=True), USER: ApiKeyRule(USER, "default")}


@pytest.mark.parametrize("path", ["/", "/status"])
def test_the_page_asks_a_browser_for_a_key(path):
    status, headers, body = _status(KEYS, path)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_the_json_refuses_without_a_browser_dialog():
    status, headers, _ = _status(KEYS, "/status.json")
    assert status == 401 and "WWW-Authenticate" not in headers


def test_a_key_without_admin_is_forbidden():
    status, _, body = _status(KEYS, "/status", headers={"Authorization": f"Bearer {USER}"})
    assert status == 403 and json.loads(body)["error"]["code"] == "not_admin"


@pytest.mark.parametrize("auth", ["bearer", "basic"])
def test_an_admin_key_opens_a_session_and_never_travels_in_the_page(auth):
    header = f"Bearer {ADMIN}" if auth == "bearer" else "Basic " + base64.b64encode(f"ops:{ADMIN}".encode()).decode()

    async def run():
        async with TestClient(TestServer(_app(KEYS))) as client:
            page = await client.get("/status", headers={"Authorization": header})
            body, cookie = await page.text(), page.cookies[SESSION_COOKIE]
            polled = await client.get("/status.json")  # the cookie alone: what the page's polls send
            await client.post("/status/logout")
            after = await client.get("/status.json")
            return page, body, cookie, polled.status, after.status
    page, body, cookie, polled, after = asyncio.run(run())
    assert page.status == 200 and page.headers["Cache-Control"] == "no-store" and ADMIN not in body
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and ADMIN not in cookie.value
    assert polled == 200  # let in by the cookie alone
    assert after == 401  # the session ended


def test_a_login_post_opens_a_session_and_a_wrong_or_non_admin_key_does_not():
    async def run():
        async with TestClient(TestServer(_app(KEYS))) as client:
            wrong = await client.post("/status/login", data={"key": "nope"}, allow_redirects=False)
            user = await client.post("/status/login", data={"key": USER}, allow_redirects=False)
            assert SESSION_COOKIE not in client.session.cookie_jar.filter_cookies(client.make_url("/"))
            login = await client.post("/status/login", data={"key": ADMIN}, allow_redirects=False)
            polled = await client.get("/status.json")
            client.session.cookie_jar.clear()
            client.session.cookie_jar.update_cookies({SESSION_COOKIE: "forged"})
            form = await client.get("/status", headers={"Accept": "text/html"})
            return (wrong.status, user.status, login.status, login.headers["Location"], polled.status, form.status,
                    await form.text())
    wrong, user, login, location, polled, form, page = asyncio.run(run())
    assert (wrong, user, login, location, polled) == (401, 403, 303, "/status", 200)
    assert form == 401 and 'action="/status/login"' in page  # a forged session: a browser gets the sign-in form


def test_a_session_ends_with_its_time_or_when_its_key_loses_admin():
    now = [0.0]
    sessions = StatusSessions(ttl_s=10, max_sessions=2, clock=lambda: now[0])
    token = sessions.start(ADMIN)
    assert sessions.key(token) == ADMIN and sessions.key("forged") is None and sessions.key(None) is None
    now[0] = 10.0
    assert sessions.key(token) is None
    first, *_ = [sessions.start(ADMIN) for _ in range(3)]
    assert sessions.key(first) is None  # the oldest dropped past max_sessions

    async def run():  # a key no longer admin in the policy in force: its session is refused
        keys = dict(KEYS)
        app = _app(keys)
        async with TestClient(TestServer(app)) as client:
            await client.post("/status/login", data={"key": ADMIN}, allow_redirects=False)
            keys[ADMIN] = ApiKeyRule(ADMIN, "default")
            return (await client.get("/status.json")).status
    assert asyncio.run(run()) == 403


def test_without_keys_the_page_is_open_and_sets_no_session():
    status, headers, body = _status({}, "/status")
    assert status == 200 and "<canvas" in body and "Set-Cookie" not in headers


# --- what the board keeps (a real Gateway around stub peers) ---------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _board(policy: Policy = Policy("test")) -> tuple[StatusBoard, Gateway, Clock]:
    pool = SimpleNamespace(queue_length=0, tokens_per_s=0.0, workers={}, num_ready=0)
    gateway = Gateway(ServeConfig(), "m", pool, FakeEngine(), InFlightRegistry(), Metrics("m"), PolicyEnforcer(policy))
    clock = Clock()
    return StatusBoard(gateway, clock=clock), gateway, clock


def _record(clock: Clock, client_class: str, ttft: float | None = None, tpot: float | None = None,
            status: str = "finished", reason: str = "stop") -> RequestRecord:
    return RequestRecord(clock.now, "id", None, client_class, None, "m", "chat", "", status, reason, 200,
                         ttft_s=ttft, tpot_s=tpot)


def test_latency_percentiles_per_class_over_the_last_15_minutes():
    board, _, clock = _board()
    for i in range(1, 101):
        board.observe(_record(clock, "standard", ttft=i / 100, tpot=i / 1000))
    board.observe(_record(clock, "batch", ttft=None, reason="abort"))  # ended before its first token
    latency = board.snapshot()["latency"]
    assert latency["standard"] == {"requests": 100, "ttft_p50_s": 0.5, "ttft_p95_s": 0.95, "tpot_p50_s": 0.05,
                                   "tpot_p95_s": 0.095}
    assert latency["batch"] == {"requests": 1, "ttft_p50_s": None, "ttft_p95_s": None, "tpot_p50_s": None,
                                "tpot_p95_s": None}
    clock.now += WINDOW_S / 2
    board.observe(_record(clock, "standard", ttft=2.0))
    clock.now += WINDOW_S / 2 + 1  # the first hundred and the batch request are older than the window now
    snapshot = board.snapshot()
    assert snapshot["latency"] == {"standard": {"requests": 1, "ttft_p50_s": 2.0, "ttft_p95_s": 2.0,
                                                "tpot_p50_s": None, "tpot_p95_s": None}}
    assert snapshot["requests"] == {"finished": 102, "finished_by_reason": {"stop": 101, "abort": 1}, "rejected": 0}


def test_rejections_by_reason_recent_and_since_start():
    board, _, clock = _board()
    board.observe(_record(clock, "", status="rejected", reason="invalid_api_key"))
    clock.now += WINDOW_S + 1
    board.observe(_record(clock, "", status="rejected", reason="queue_full"))
    board.observe(_record(clock, "", status="rejected", reason="queue_full"))
    snapshot = board.snapshot()
    assert snapshot["rejections"] == {"recent": {"queue_full": 2},
                                      "total": {"invalid_api_key": 1, "queue_full": 2}}
    assert snapshot["requests"]["rejected"] == 3 and snapshot["latency"] == {}


def test_the_ring_buffer_holds_15_minutes_and_polls_get_only_newer_samples():
    board, _, clock = _board()
    for _ in range(1000):
        board.sample()
        clock.now += 1
    samples = board.snapshot()["samples"]
    assert len(samples) == 900 and samples[0][0] == clock.now - 900
    assert [s[0] for s in board.snapshot(since=clock.now - 3)["samples"]] == [clock.now - 2, clock.now - 1]


def test_tier_changes_are_stamped_when_seen():
    tier = Tier("busy", {"waiting_requests": 1.0}, {"waiting_requests": 0.5}, min_dwell_s=0)
    board, gateway, clock = _board(Policy("test", tiers=(tier,)))
    gateway.enforcer.update_signals({"waiting_requests": 2.0})
    snapshot = board.snapshot()
    assert snapshot["tier"]["name"] == "busy" and snapshot["tier"]["tiers"] == ["normal", "busy"]
    assert snapshot["transitions"] == [{"time": clock.now, "before": "normal", "after": "busy",
                                        "reason": "busy enter holds: waiting_requests=2 >= 1"}]
    clock.now += 5
    assert board.snapshot()["transitions"][0]["time"] == clock.now - 5  # stamped once


# --- the real server in a real browser ---------------------------------------------------------------------------

# Deadlines for waiting on the page and the server: generous, for a machine busy with other work (a broken page still
# fails them, it never gets there); the 3 s of the tier test is measured from the page's own clock, not waited on.
READY_S = 60.0  # the page loaded and its first poll rendered
STATE_S = 30.0  # the page shows a state the server is already in
CALL_S = 60.0  # one DevTools call answered

READ_PAGE = """(() => {
  // not (yet) the page, or still loading: a half-parsed table has no tBody to read
  if (document.readyState !== "complete" || !document.body || document.body.dataset.polls === undefined)
    return {polls: -1};
  const out = {polls: Number(document.body.dataset.polls), tables: {}};
  for (const e of document.querySelectorAll('[id^="v-"]')) out[e.id] = e.textContent;
  for (const t of document.querySelectorAll("table"))
    out.tables[t.id] = Object.fromEntries([...t.tBodies[0].rows].map(r => [r.dataset.key,
                                                                              [...r.cells].map(c => c.textContent)]));
  return out;
})()"""
# when the tier badge first showed each tier, by the page's clock (ms since the epoch, the clock time.time() reads)
WATCH_TIER = """(() => {
  const badge = document.getElementById("v-tier");
  window.tierShown = {[badge.textContent]: Date.now()};
  new MutationObserver(() => { window.tierShown[badge.textContent] ??= Date.now(); })
    .observe(badge, {childList: true, characterData: true, subtree: true});
  return true;
})()"""


class DevToolsError(RuntimeError):
    """The browser answered a call with an error (e.g. the page's context went away while it navigated)."""


class Page:
    """One browser tab, spoken to over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.last_id = ws, 0

    async def call(self, method: str, **params) -> dict:
        self.last_id += 1
        await self.ws.send_json({"id": self.last_id, "method": method, "params": params})
        async with asyncio.timeout(CALL_S):
            async for message in self.ws:  # events arrive in between; the answer carries our id
                data = json.loads(message.data)
                if data.get("id") == self.last_id:
                    if "error" in data:
                        raise DevToolsError(f"{method}: {data['error']}")
                    return data["result"]
        raise RuntimeError(f"{method}: the browser closed the connection")

    async def evaluate(self, expression: str, timeout_s: float = READY_S):
        """The expression's value. While the page loads, evaluate may fail (its context replaced as it navigates)
        or throw (an exception result, which has no value): asked again until timeout_s, then the failure raised."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                answer = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
                if "exceptionDetails" not in answer and "value" in answer["result"]:
                    return answer["result"]["value"]
                failure = answer.get("exceptionDetails", answer["result"])
            except DevToolsError as err:
                failure = err
            if time.monotonic() > deadline:
                raise AssertionError(f"the page did not evaluate {expression[:60]!r} in {timeout_s} s: {failure}")
            await asyncio.sleep(0.1)

    async def read(self) -> dict:
        return await self.evaluate(READ_PAGE)

    async def until(self, predicate, timeout_s: float = STATE_S) -> dict:
        """Read the page every 0.1 s until it is loaded and predicate(page) holds; the last reading either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            page = await self.read()
            if (page["polls"] >= 0 and predicate(page)) or time.monotonic() > deadline:
                return page
            await asyncio.sleep(0.1)

    async def ready(self) -> dict:
        """Wait for the page to load and render its first poll's data."""
        page = await self.until(lambda p: p["polls"] >= 1, READY_S)
        assert page["polls"] >= 1, f"the page did not load and render a poll in {READY_S} s: {page}"
        return page


class Browser:
    def __init__(self, binary: str, workdir) -> None:
        port_file = workdir / "DevToolsActivePort"  # "<port>\n<path>" once it listens
        port_file.unlink(missing_ok=True)  # a reused profile's is stale
        self.process = subprocess.Popen(
            [binary, "--headless=new", "--disable-gpu", "--no-sandbox", "--no-first-run", "--remote-debugging-port=0",
             f"--user-data-dir={workdir}", "--window-size=1280,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_for(lambda: port_file.exists() and len(port_file.read_text().split()) == 2, 60), \
            "chromium did not open its DevTools port"
        self.port = int(port_file.read_text().split()[0])

    @contextlib.asynccontextmanager
    async def open(self, url: str):
        """A tab on url, once the page has loaded and rendered its first poll."""
        devtools = f"http://127.0.0.1:{self.port}"
        async with aiohttp.ClientSession() as session:
            async with session.put(f"{devtools}/json/new") as response:
                target = await response.json(content_type=None)
            try:
                async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    page = Page(ws)
                    await page.call("Page.navigate", url=url)
                    await page.ready()
                    yield page
            finally:
                async with session.get(f"{devtools}/json/close/{target['id']}"):
                    pass

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


server = served(CONFIG, POLICY, "status-serve")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)
    if binary is None:
        pytest.skip(f"no Chromium binary ({', '.join(CHROMIUM_NAMES)}) on PATH; as root with apt-get, "
                    f"`make install` installs Debian's")
    browser = Browser(binary, tmp_path_factory.mktemp("chromium"))
    yield browser
    browser.close()


def page_url(server) -> str:
    """Basic auth in the URL: what a browser sends after asking the operator (any user name, the key)."""
    return server.base.replace("http://", f"http://ops:{ADMIN}@") + "/status"


def metrics(server) -> str:
    return httpx.get(server.base + "/metrics", timeout=STATE_S).text


def metric_sum(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if re.match(re.escape(name) + r"[{ ]", line) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def idle(text: str) -> bool:
    return metric_sum(text, "edge:kv_cache_blocks_used") == 0 and metric_sum(text, "vllm:num_requests_running") == 0


def complete(server, key: str, max_tokens: int = 24) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Counting: 1, 2, 3,", "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(server.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


@pytest.mark.slow
def test_the_real_server_lets_only_an_admin_key_see_it(server):
    assert httpx.get(server.base + "/status", timeout=5).status_code == 401
    assert httpx.get(server.base + "/status", headers={"Authorization": f"Bearer {USER}"}, timeout=5).status_code == 403
    assert httpx.get(server.base + "/", auth=("ops", ADMIN), timeout=5).status_code == 200
    body = httpx.get(server.base + "/status.json", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).json()
    assert set(body["processes"]) == {"decode_engine", "prefill-0"} and body["tier"]["name"] == "normal"


@pytest.mark.slow
def test_the_page_renders_its_numbers(server, browser):
    async def scenario():
        async with browser.open(page_url(server)) as page:
            shown = await page.until(lambda p: p["polls"] >= 2)
        assert shown["polls"] >= 2 and shown["v-error"] == "", shown
        assert shown["v-tier"] == "normal" and shown["v-model"] == MODEL
        assert shown["v-kv-total"] == str(int(metric_sum(metrics(server), "edge:kv_cache_blocks_total")))
        processes = shown["tables"]["processes"]
        assert set(processes) == {"decode_engine", "prefill-0"}
        assert all(row[1:3] == ["running", "ready"] for row in processes.values()), processes
    asyncio.run(scenario())


@pytest.mark.slow
def test_under_load_its_numbers_match_metrics(server, browser):
    async def scenario():
        async with browser.open(page_url(server)) as page:
            before = await page.read()
            threads = [threading.Thread(target=complete, args=(server, key)) for key in (USER, USER, BATCH, BATCH)]
            for t in threads:
                t.start()
            await asyncio.to_thread(complete, server, "wrong-key")
            await asyncio.to_thread(complete, server, USER, -1)  # max_tokens out of range
            for t in threads:
                await asyncio.to_thread(t.join)
            done = int(before["v-finished"]) + 4
            # the engine reports its stats periodically: compare once it says the batch has left the pool
            assert await asyncio.to_thread(wait_for, lambda: idle(metrics(server)), STATE_S)
            shown = await page.until(lambda p: p["v-finished"] == str(done) and p["v-kv-used"] == "0")
        text = metrics(server)
        assert shown["v-finished"] == str(done) == str(int(metric_sum(text, "vllm:request_success_total")))
        rejected = {reason: int(row[2]) for reason, row in shown["tables"]["rejections"].items()}
        assert rejected == {"invalid_api_key": 1, "invalid_value": 1}
        assert all(rejected[r] == metric_sum(text, "edge:requests_rejected_total", reason=r) for r in rejected)
        assert shown["v-rejected"] == "2"
        assert shown["v-kv-used"] == str(int(metric_sum(text, "edge:kv_cache_blocks_used")))
        assert shown["v-kv-total"] == str(int(metric_sum(text, "edge:kv_cache_blocks_total")))
        assert shown["v-tier"] == "normal" and metric_sum(text, "edge:degradation_tier") == 0
        latency = shown["tables"]["latency"]
        assert latency["standard"][1] == "2" and latency["batch"][1] == "2", latency
        assert all(row[2].endswith(" ms") or row[2].endswith(" s") for row in latency.values()), latency
    asyncio.run(scenario())


async def first_seen(http: aiohttp.ClientSession, server, tier: str, timeout_s: float) -> float | None:
    """time.time() when /health first says the tier is in force (polled every 0.05 s), or None past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with http.get(server.base + "/health") as response:
            if (await response.json())["policy"]["tier"] == tier:
                return time.time()
        await asyncio.sleep(0.05)
    return None


@pytest.mark.slow
def test_a_forced_tier_change_shows_within_3_s(server, browser):
    """The delay is the page's clock when its badge changed (a MutationObserver) against the test's clock when /health
    said so first, both the machine's wall clock: the readings of a busy test loop do not add to it."""
    async def scenario():
        async with browser.open(page_url(server)) as page, aiohttp.ClientSession() as http:
            assert await page.evaluate(WATCH_TIER)
            server.policy.write_text(FORCED_TIER)  # the gateway polls the file every second
            server_at = await first_seen(http, server, "forced", READY_S)
            shown = await page.until(lambda p: p["v-tier"] == "forced" and "0" in p["tables"]["transitions"])
            page_at_ms = await page.evaluate("window.tierShown.forced ?? null")
        assert server_at is not None, "the server did not enter the forced tier"
        assert page_at_ms is not None, f"the page did not show the forced tier {STATE_S} s after the server: {shown}"
        delay_s = page_at_ms / 1e3 - server_at
        assert delay_s <= 3.0, f"the page showed the new tier {delay_s:.1f} s after the server"
        assert shown["tables"]["transitions"]["0"][1:3] == ["normal", "forced"]
        assert "waiting_requests" in shown["v-tier-reason"]
    try:
        asyncio.run(scenario())
    finally:
        server.policy.write_text(POLICY)


def test_the_kv_tiers_are_summed_over_the_workers():
    from contracts.messages import CacheTier
    board, gateway, _ = _board()
    gateway.pool.workers = {
        "w0": SimpleNamespace(state="ready", last_error=None,
                              cache_tiers=(CacheTier("ram", 3, 1, 2, 100, 1000, 0), CacheTier("returned", 2, 1))),
        "w1": SimpleNamespace(state="ready", last_error=None, cache_tiers=(CacheTier("ram", 1, 4, 1, 50, 1000, 2),)),
    }
    tiers = board.snapshot()["prefill"]["cache_tiers"]
    assert tiers["ram"] == {"hits": 4, "misses": 5, "entries": 3, "bytes": 150, "max_bytes": 2000, "evictions": 2}
    assert tiers["returned"]["hits"] == 2 and tiers["returned"]["misses"] == 1
    assert set(tiers["engine_prefix"]) == {"hits", "misses"}
