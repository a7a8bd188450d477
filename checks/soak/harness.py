"""The soak itself: a warm-up, then client threads (valid and hostile requests), the fault injector and the RSS
sampler against one started service for the soak's length; then settle, probe, stop, and judge (run_soak)."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx

from checks.soak.client import WORDS, Result, Spec, bad_specs, good_spec, probe_classes, send
from checks.soak.faults import RECOVERY_BOUND_S, FaultInjector
from checks.soak.memory import RssSampler, leftovers, rss_rows
from checks.soak.report import Report, judge_faults, judge_requests, judge_service
from checks.soak.service import CLIENT_DEADLINE_S, CONFIG, MODEL, POLICY, Service, settle
from server_process import ServerProcess

WARMUP_PROMPTS = 10  # long prompts before the soak: the workers' prompt caches overflow, every buffer size is met


class Soak:
    """Runs the load, the faults and the RSS sampler against one started service."""

    def __init__(self, server: ServerProcess, duration_s: float) -> None:
        self.service, self.duration_s = Service(server), duration_s
        self.load_over = threading.Event()
        self.results: list[Result] = []  # list.append is atomic: the client threads share it
        self.injector = FaultInjector(self.service, self.load_over)
        self.sampler = RssSampler(self.service)
        self.stuck_threads = 0

    def warm_up(self, seed: int) -> None:
        """Long prompts on two threads (one per worker) before the clock starts, so that memory is compared
        after the first prompts of every size, not across them."""
        def one_thread(rng: random.Random) -> None:
            with httpx.Client(base_url=self.service.server.base) as client:
                for _ in range(WARMUP_PROMPTS // 2):
                    text = " ".join(f"{rng.choice(WORDS)}{rng.randrange(10 ** 6)}" for _ in range(120))
                    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 32}).encode()
                    self.record(client, Spec("warm-up completion", "/v1/completions", body))
        for thread in [_thread(one_thread, random.Random(seed - i)) for i in (1, 2)]:
            thread.join()
        self.service.t0 = time.monotonic()

    def run(self, clients: int, seed: int) -> None:
        self.warm_up(seed)
        load = [_thread(self.client_loop, seed + i) for i in range(clients)] + [_thread(self.bad_loop, seed)]
        faults, sampler = _thread(self.injector.loop, self.duration_s), _thread(self.sampler.loop)
        self.load_over.wait(self.duration_s)  # nobody sets it early: this is the soak's length
        self.load_over.set()
        for thread in load:
            thread.join(CLIENT_DEADLINE_S + 10)  # every request carries its own deadline
        faults.join(RECOVERY_BOUND_S + 30)
        self.stuck_threads = sum(t.is_alive() for t in (*load, faults))
        self.sampler.over = True
        sampler.join(10)

    def record(self, client: httpx.Client, spec: Spec) -> Result:
        at = self.service.now()
        result = Result(spec.label, spec.bad, at, *send(client, spec))
        self.results.append(result)
        return result

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.service.server.base) as client:
            while not self.load_over.is_set():
                result = self.record(client, good_spec(rng))
                # a refused client waits as Retry-After asks (capped), as a real one would
                self.load_over.wait(1.0 if result.status in (429, 503) else rng.uniform(0, 0.4))

    def bad_loop(self, seed: int) -> None:
        rng, specs = random.Random(seed + 1000), bad_specs()
        with httpx.Client(base_url=self.service.server.base) as client:
            for i in range(10 ** 9):
                if self.load_over.wait(rng.uniform(0.5, 2.0)):
                    return
                self.record(client, specs[i % len(specs)])


def _thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def run_soak(duration_s: float, workdir: Path, clients: int = 3, seed: int = 0,
             warmup_s: float | None = None) -> Report:
    """Start the service, soak it, stop it, and judge. warmup_s: RSS is compared from this long after each
    process is first seen (default: the first minute, or a third of a shorter soak)."""
    server = ServerProcess(CONFIG, workdir, POLICY).start()
    exit_code = None
    try:
        soak = Soak(server, duration_s)
        soak.run(clients, seed)
        settled = settle(server)
        probes = probe_classes(server)
        soak.sampler.sample()  # the end point of every RSS comparison: after the load, settled
        end_s = soak.service.now()
    finally:
        try:
            exit_code = server.stop()
        except Exception as err:  # noqa: BLE001  (a gateway that would not stop is a finding, not a crash)
            exit_code = f"did not stop: {err!r}"
    samples, procs = soak.sampler.samples, soak.sampler.procs
    rss = rss_rows(samples, warmup_s if warmup_s is not None else min(60.0, duration_s / 3), end_s)
    report = Report(duration_s, soak.results, soak.injector.faults, rss, log_path=server.log_path)
    (workdir / "rss.json").write_text(json.dumps([{"name": name, "pid": pid, "samples": series}
                                                  for (name, pid), series in samples.items()]))
    judge_requests(report, soak.stuck_threads)
    judge_faults(report)
    judge_service(report, settled, probes, exit_code, leftovers(procs), len(procs))
    return report
