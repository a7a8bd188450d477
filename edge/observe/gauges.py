"""The /metrics values mirrored from elsewhere at each scrape: the engines' last stats (gauges, and their running
totals as Prometheus counters), the prefill pool's queue and speed, the policy's degradation tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edge.core.engine_link import EMPTY_STATS

if TYPE_CHECKING:
    from edge.core.gateway import Gateway


def refresh_gauges(gateway: Gateway) -> None:
    m, stats = gateway.metrics, gateway.engine_stats
    m.label(m.prefill_queue).set(gateway.pool.queue_length)
    m.label(m.prefill_tps).set(gateway.pool.tokens_per_s)
    waiting, used, total = gateway.load()
    m.label(m.waiting).set(waiting)
    m.label(m.running).set(stats.num_running)
    m.label(m.kv_blocks_used).set(used)
    m.label(m.kv_blocks_total).set(total)
    m.label(m.kv_usage).set(used / total if total else 0.0)
    m.preemptions_seen = _advance_counter(m.label(m.preemptions), m.preemptions_seen, stats.num_preemptions)
    totals = {"pool_queries": (m.label(m.prefix_cache_queries, where="pool"), stats.prefix_cache_queries),
              "pool_hits": (m.label(m.prefix_cache_hits, where="pool"), stats.prefix_cache_hits),
              "drafts": (m.label(m.spec_drafts), stats.num_spec_drafts),
              "draft_tokens": (m.label(m.spec_draft_tokens), stats.num_spec_draft_tokens),
              "accepted": (m.label(m.spec_accepted_tokens), stats.num_spec_accepted_tokens)}
    for key, (counter, total) in totals.items():
        m.engine_totals_seen[key] = _advance_counter(counter, m.engine_totals_seen.get(key, 0), total)
    m.label(m.decode_tps).set(stats.tokens_per_s)
    m.label(m.decode_yielded).set(stats.decode_yielded_s)
    m.label(m.tier).set(gateway.enforcer.tier_state_of(gateway.model_name).index + 1)  # its model's tier
    for name, client in gateway.engine.links().items():
        own = client.stats or EMPTY_STATS
        m.label(m.engine_up, engine=name).set(1 if client.state == "ready" else 0)
        m.label(m.engine_running, engine=name).set(own.num_running)
        m.label(m.engine_waiting, engine=name).set(own.num_waiting)
        m.label(m.engine_kv_usage, engine=name).set(own.kv_blocks_used / own.kv_blocks_total
                                                    if own.kv_blocks_total else 0.0)


def _advance_counter(counter, seen: int, total: int) -> int:
    """Mirror an engine-side running total into a Prometheus counter (a restarted engine starts again at 0)."""
    counter.inc(max(0, total - seen) if total >= seen else total)
    return total
