"""Prometheus metrics, with vLLM's names where one exists (so existing dashboards work) and edge:* for the rest."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.running = Gauge("vllm:num_requests_running", "Requests decoding in the engine", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting (prefill queue and engine queue)",
                             labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", labels,
                              registry=r)
        self.kv_blocks_used = Gauge("edge:kv_cache_blocks_used", "KV cache blocks in use", labels, registry=r)
        self.kv_blocks_total = Gauge("edge:kv_cache_blocks_total", "KV cache blocks in the pool", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted in the decode engine", labels,
                                   registry=r)
        self.preemptions_seen = 0  # the engine's running total when last mirrored into the counter
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of a stream", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time in the prefill queue", labels,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Prefill on a worker, handoff sent included (the last try if preempted)",
                                      labels, buckets=LATENCY_BUCKETS, registry=r)
        # where: "worker" (llama.cpp's prompt cache: prefill skipped) or "pool" (the decode pool: import skipped)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in a prefix cache",
                                            labels + ["where"], registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in a prefix cache",
                                         labels + ["where"], registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative drafts verified", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", labels,
                                         registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels,
                                            registry=r)
        self.engine_totals_seen: dict[str, int] = {}  # engine-side running totals when last mirrored into counters
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", labels, registry=r)
        self.finished = Counter("vllm:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.rejected = Counter("edge:requests_rejected", "Requests refused before model work, by reason",
                                labels + ["reason"], registry=r)
        self.api_requests = Counter("edge:api_requests", "Requests by HTTP route and how they ended (finished, "
                                    "aborted, failed, rejected)", labels + ["route", "status"], registry=r)
        self.failed = Counter("edge:requests_failed", "Accepted requests that ended in an error", labels, registry=r)
        self.prefill_queue = Gauge("edge:prefill_queue_length", "Prompts waiting for a prefill worker", labels,
                                   registry=r)
        self.prefill_tps = Gauge("edge:prefill_tokens_per_second", "Recent llama.cpp prefill speed", labels,
                                 registry=r)
        self.handoff_bytes = Histogram("edge:handoff_bytes", "KV handoff message size", labels,
                                       buckets=(1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8), registry=r)
        self.handoff_seconds = Histogram("edge:handoff_seconds", "KV export, encode and send time", labels,
                                         buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1), registry=r)
        self.tier = Gauge("edge:degradation_tier", "Degradation tier in force: 0 normal, n the n-th tier of the policy",
                          labels, registry=r)
        self.tier_transitions = Counter("edge:degradation_tier_transitions", "Tier changes",
                                        labels + ["before", "after"], registry=r)
        self.policy_reload_failures = Counter("edge:policy_reload_failures", "Policy files refused on reload",
                                              labels, registry=r)
        self.decode_yielded = Gauge("edge:decode_yielded_seconds",
                                    "Time decode paused for more important prompts in prefill (CPU boxes)",
                                    labels, registry=r)
        self.decode_tps = Gauge("edge:decode_tokens_per_second", "Recent decode throughput", labels, registry=r)
        # per decode engine (several with edge serve --ray; "decode_engine" on one box)
        engine = labels + ["engine"]
        self.engine_up = Gauge("edge:engine_up", "1 while the gateway is connected to this decode engine", engine,
                               registry=r)
        self.engine_running = Gauge("edge:engine_requests_running", "Requests decoding in this engine", engine,
                                    registry=r)
        self.engine_waiting = Gauge("edge:engine_requests_waiting", "Requests waiting for admission in this engine",
                                    engine, registry=r)
        self.engine_kv_usage = Gauge("edge:engine_kv_cache_usage_perc", "Fraction of this engine's KV blocks in use",
                                     engine, registry=r)
        self.engine_requests = Counter("edge:engine_requests", "Requests ended that were routed to this engine "
                                       "(through the prefill worker that hands off to it)", engine,
                                       registry=r)

    def label(self, metric, **extra):
        return metric.labels(model_name=self.model_name, **extra)

    def render(self, *others: Metrics) -> bytes:
        """The text page; with `others` (issue 45: each loaded model's own), one page of all, each family once with
        every model's samples (its model_name label tells them apart)."""
        return generate_latest(_Merged([self.registry, *(m.registry for m in others)]) if others else self.registry)


class _Merged:
    """Several registries as one for generate_latest: a family named in several holds the samples of each."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self):
        families = {}
        for registry in self.registries:
            for family in registry.collect():  # fresh objects at each collect: extending them changes nothing kept
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())
