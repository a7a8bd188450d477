"""Several decode engines behind the gateway (edge.engine_group), without Ray: choosing an engine by load, a lost
engine ending only its own requests, and single-box mode not importing Ray."""

import subprocess
import sys

from contracts.events import EngineStats
from edge.engine_client import EngineClient
from edge.engine_group import EngineGroup
from edge.lifecycle import InFlight, InFlightRegistry, RequestStatus


def stats(used: int, total: int = 100, running: int = 0) -> EngineStats:
    return EngineStats(used, total, total * 16, 0, running, 0, 0, 1.0, 10.0, 0)


def group_of(registry: InFlightRegistry) -> EngineGroup:
    clients = {name: EngineClient("", registry, b"", name) for name in ("decode-0", "decode-1")}
    for client in clients.values():
        client.state = "ready"
    return EngineGroup(clients, {"prefill-0": "decode-0", "prefill-1": "decode-1"}, registry)


def request(registry: InFlightRegistry, rid: str, worker: str, status: RequestStatus) -> InFlight:
    inflight = InFlight(rid, 0)
    inflight.worker, inflight.status = worker, status
    registry.add(inflight)
    return inflight


def test_the_worker_of_the_less_loaded_engine_ranks_first():
    registry = InFlightRegistry()
    group = group_of(registry)
    request(registry, "a", "prefill-0", RequestStatus.DECODING)
    assert group.rank_worker("prefill-1") < group.rank_worker("prefill-0")
    request(registry, "b", "prefill-1", RequestStatus.PREFILLING)
    group.clients["decode-1"].stats = stats(used=60)  # same count, more KV in use
    group.clients["decode-0"].stats = stats(used=10)
    assert group.rank_worker("prefill-0") < group.rank_worker("prefill-1")
    group.clients["decode-0"].state = "down"  # a down engine ranks last
    assert group.rank_worker("prefill-0") == float("inf") > group.rank_worker("prefill-1")


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
    mine = request(registry, "mine", "prefill-0", RequestStatus.DECODING)
    other = request(registry, "other", "prefill-1", RequestStatus.DECODING)
    group.clients["decode-0"].closing = True
    group.clients["decode-0"]._lost()
    assert mine.events.get_nowait().error_code == "engine_unavailable"
    assert other.events.empty()


def test_single_box_mode_imports_no_ray(tmp_path):
    code = ("import sys; from edge.config import ServeConfig; import edge.app, edge.cli; "
            f"edge.app.make_app(ServeConfig(launch=False, run_dir='{tmp_path}')); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
