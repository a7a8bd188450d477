"""The first-burst bench's baseline and server-side refusal span (bench/slo_first_burst.py, issue 47)."""

from bench.slo_first_burst import refusal_span_ms, sequential_fit


def test_sequential_fit_counts_the_first_tokens_whose_ttfts_sum_within_the_budget():
    assert sequential_fit([0.5, 0.5, 0.5, 0.5], 1.5) == 3
    assert sequential_fit([0.4, 0.4, 0.8], 1.5) == 2
    assert sequential_fit([1.6], 1.5) == 0
    assert sequential_fit([], 1.5) == 0


def test_the_refusal_span_reads_only_refusal_lines_after_the_offset(tmp_path):
    log = tmp_path / "server.log"
    before = "2026-12-06 15:00:00,000 INFO [gateway] edge.core.slo: refused a request of class 'chat': earlier\n"
    log.write_text(before +
                   "2026-12-06 15:00:01,100 INFO [gateway] edge.core.slo: refused a request of class 'chat': x\n"
                   "2026-12-06 15:00:01,150 INFO [gateway] edge.core.gateway: request chatcmpl-1 finished\n"
                   "2026-12-06 15:00:01,340 INFO [gateway] edge.core.slo: refused a request of class 'chat': y\n")
    assert abs(refusal_span_ms(log, len(before)) - 240.0) < 1e-6
    assert abs(refusal_span_ms(log, 0) - 1340.0) < 1e-6
    assert refusal_span_ms(tmp_path / "missing.log", 0) is None
