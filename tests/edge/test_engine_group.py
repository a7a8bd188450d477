"""Several decode engines behind the gateway (edge.core.engine_group), without Ray: choosing an engine per request by
load and by prefix affinity, a lost engine ending only its own requests, /health listing each engine, and
single-box mode not importing Ray."""

import asyncio
import subprocess
import sys

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from contracts.events import EngineStats
from contracts.handoff import SamplingParams
from contracts.messages import PrefillJob
from edge.config import ServeConfig
from edge.core.affinity import PrefixAffinity, prefix_key
from edge.core.engine_client import EngineClient
from edge.core.engine_group import AFFINITY_MARGIN, EngineGroup
from edge.core.gateway import Gateway
from edge.core.lifecycle import InFlight, InFlightRegistry, RequestStatus
from edge.core.metrics import Metrics
from edge.core.prefill_pool import PrefillPool, WorkerClient
from edge.http.routes import add_routes
from edge.state import GATEWAY
from policies.enforcer import PolicyEnforcer
from policies.schema import Policy

SYSTEM = "You are the assistant of an on-prem appliance. Answer briefly and precisely. " * 5  # > PREFIX_CHARS


def stats(used: int, total: int = 100, running: int = 0) -> EngineStats:
    return EngineStats(used, total, total * 16, 0, running, 0, 0, 1.0, 10.0, 0)


def group_of(registry: InFlightRegistry, affinity: PrefixAffinity | None = None) -> EngineGroup:
    clients = {name: EngineClient(f"tcp://10.0.0.{i}:7000", registry, b"", name)
               for i, name in enumerate(("decode-0", "decode-1"))}
    for client in clients.values():
        client.state = "ready"
    return EngineGroup(clients, registry, affinity)


def request(registry: InFlightRegistry, rid: str, engine: str, status: RequestStatus) -> InFlight:
    inflight = InFlight(rid, 0)
    inflight.engine, inflight.status = engine, status
    registry.add(inflight)
    return inflight


def chat_key(user: str) -> bytes:
    return prefix_key(None, ({"role": "system", "content": SYSTEM}, {"role": "user", "content": user}), None)


def test_each_request_goes_to_the_less_loaded_engine_and_its_job_names_it():
    registry = InFlightRegistry()
    group = group_of(registry)
    request(registry, "a", "decode-0", RequestStatus.DECODING)
    fresh = request(registry, "fresh", "", RequestStatus.WAITING)
    assert group.choose("fresh") == "tcp://10.0.0.1:7000" and fresh.engine == "decode-1"
    fresh.status = RequestStatus.PREFILLING  # counts at once, before the engine hears of it
    group.clients["decode-1"].stats = stats(used=60)  # same count, more KV in use
    group.clients["decode-0"].stats = stats(used=10)
    assert group.pick(None) == "decode-0"
    group.clients["decode-0"].state = "down"  # a down engine is never chosen
    assert group.pick(None) == "decode-1"
    group.clients["decode-1"].state = "connecting"
    assert group.pick(None) is None and group.choose("fresh") is None  # none ready: the job waits


def test_a_shared_prefix_follows_its_engine_under_equal_load():
    registry = InFlightRegistry()
    group = group_of(registry)
    request(registry, "other", "decode-1", RequestStatus.DECODING)  # decode-0 is the less loaded now
    first = request(registry, "first", "", RequestStatus.WAITING)
    first.prefix_key = chat_key("What is a firewall?")
    assert group.choose("first") == "tcp://10.0.0.0:7000"
    registry.remove("other")
    request(registry, "busy", "decode-0", RequestStatus.DECODING)  # now decode-1 is the less loaded
    second = request(registry, "second", "", RequestStatus.WAITING)
    second.prefix_key = chat_key("And what is a router?")  # same system prompt, another question
    assert group.choose("second") == "tcp://10.0.0.0:7000" and group.num_affinity_hits == 1
    third = request(registry, "third", "", RequestStatus.WAITING)
    third.prefix_key = prefix_key(None, ({"role": "user", "content": "Unrelated"},), None)
    assert group.choose("third") == "tcp://10.0.0.1:7000"  # no prefix seen before: load decides


def test_load_wins_over_affinity_past_the_margin():
    registry = InFlightRegistry()
    group = group_of(registry)
    key = chat_key("q")
    group.affinity.remember(key, "decode-0")
    for i in range(int(AFFINITY_MARGIN)):  # decode-0 busier by exactly the margin: affinity still holds
        request(registry, f"r{i}", "decode-0", RequestStatus.DECODING)
    assert group.pick(key) == "decode-0"
    request(registry, "one-more", "decode-0", RequestStatus.DECODING)
    assert group.pick(key) == "decode-1"
    for i in range(12):  # under heavy load the margin is a share of the lighter engine's load: 12 + 3 may hold
        request(registry, f"a{i}", "decode-0", RequestStatus.DECODING)
        request(registry, f"b{i}", "decode-1", RequestStatus.DECODING)
    assert group.pick(key) == "decode-0"
    group.clients["decode-0"].state = "down"  # a down engine loses its prefixes' requests, whatever the load
    assert group.pick(key) == "decode-1"


def test_the_affinity_map_is_bounded_and_keeps_the_recently_used():
    affinity = PrefixAffinity(max_keys=3)
    keys = [prefix_key(f"prompt {i}", None, None) for i in range(5)]
    for key in keys[:3]:
        affinity.remember(key, "decode-0")
    affinity.remember(keys[0], "decode-1")  # used again: now the most recent
    affinity.remember(keys[3], "decode-0")
    affinity.remember(keys[4], "decode-0")
    assert len(affinity) == 3 and affinity.get(keys[1]) is None and affinity.get(keys[2]) is None
    assert affinity.get(keys[0]) == "decode-1"


def test_the_prefix_key_reads_the_leading_text_and_the_kv_type():
    assert chat_key("one question") == chat_key("another question")  # the first 256 characters are the system's
    assert prefix_key("short a", None, None) != prefix_key("short b", None, None)  # short: all of it is the key
    assert prefix_key(SYSTEM, None, None) != prefix_key(SYSTEM, None, None, "q4_0")  # another KV type, another cache
    assert prefix_key(None, None, tuple(range(100))) == prefix_key(None, None, tuple(range(64)) + (9,) * 36)


def test_the_pool_sends_each_job_to_the_engine_chosen_as_a_worker_takes_it():
    async def scenario():
        registry = InFlightRegistry()
        group = group_of(registry)
        pool = PrefillPool({}, registry, queue_limit=8)
        pool.choose_engine = group.choose
        pool.workers = {"w0": WorkerClient("w0", "", state="ready")}  # connected in spirit: frames are not sent
        group.clients["decode-0"].state = group.clients["decode-1"].state = "down"
        registry.add(InFlight("r1", 0))
        pool.submit(PrefillJob("r1", SamplingParams()))
        assert pool.queue_length == 1 and pool.workers["w0"].current is None  # no engine ready: it waits
        group.clients["decode-1"].state = "ready"
        pool._dispatch()  # what a worker's next heartbeat does
        return pool.workers["w0"].current.job, registry.get("r1")

    job, inflight = asyncio.run(scenario())
    assert job.engine == "tcp://10.0.0.1:7000" and inflight.engine == "decode-1"


def test_the_group_reports_summed_stats_and_the_smallest_context():
    registry = InFlightRegistry()
    group = group_of(registry)
    group.clients["decode-0"].stats = stats(10, 100, running=2)
    group.clients["decode-1"].stats = stats(30, 50, running=1)
    total = group.stats
    assert (total.kv_blocks_used, total.kv_blocks_total, total.num_running) == (40, 150, 3)
    assert total.kv_capacity_tokens == 50 * 16


def test_a_lost_engine_ends_only_its_own_requests():
    registry = InFlightRegistry()
    group = group_of(registry)
    mine = request(registry, "mine", "decode-0", RequestStatus.DECODING)
    other = request(registry, "other", "decode-1", RequestStatus.DECODING)
    group.clients["decode-0"].closing = True
    group.clients["decode-0"]._lost()
    assert mine.events.get_nowait().error_code == "engine_unavailable"
    assert other.events.empty()


def test_health_lists_each_engine():
    registry = InFlightRegistry()
    group = group_of(registry)
    group.clients["decode-0"].stats = stats(used=25, running=1)
    group.clients["decode-1"].state, group.clients["decode-1"].last_error = "down", "connection refused"
    request(registry, "r", "decode-0", RequestStatus.DECODING)
    pool = PrefillPool({}, registry, queue_limit=8)
    pool.workers = {"prefill-0": WorkerClient("prefill-0", "", state="ready")}
    app = web.Application()
    app[GATEWAY] = Gateway(ServeConfig(), "m", pool, group, registry, Metrics("m"), PolicyEnforcer(Policy("test")))
    add_routes(app)

    async def get():
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/health")
            return response.status, await response.json()
    status, health = asyncio.run(get())
    assert status == 200 and health["status"] == "degraded"  # one engine is down, the other serves
    assert health["components"] == {"decode-0": "ready", "decode-1": "down", "prefill-0": "ready"}
    assert health["errors"] == {"decode-1": "connection refused"}
    assert health["engines"] == {
        "decode-0": {"state": "ready", "address": "tcp://10.0.0.0:7000", "requests": 1, "running": 1, "waiting": 0,
                     "kv_usage": 0.25},
        "decode-1": {"state": "down", "address": "tcp://10.0.0.1:7000", "requests": 0, "running": None,
                     "waiting": None, "kv_usage": None}}


def test_links_name_each_single_engine_and_describe_tables_only_a_group():
    registry = InFlightRegistry()
    group = group_of(registry)
    group.clients["decode-0"].stats = stats(used=25, running=1)
    request(registry, "r", "decode-0", RequestStatus.DECODING)
    assert group.links() == group.clients and group.links() is not group.clients
    assert group.describe()["decode-0"] == {"state": "ready", "address": "tcp://10.0.0.0:7000", "requests": 1,
                                            "running": 1, "waiting": 0, "kv_usage": 0.25}
    assert group.describe()["decode-1"]["running"] is None
    one = EngineClient("unix:/nowhere", registry)
    assert one.links() == {"decode_engine": one} and one.describe() is None


def test_single_box_mode_imports_no_ray(tmp_path):
    code = ("import sys; from edge.config import ServeConfig; import edge.app, edge.cli; "
            f"edge.app.make_app(ServeConfig(launch=False, run_dir='{tmp_path}')); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
