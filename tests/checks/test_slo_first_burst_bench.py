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


def test_a_refusal_is_timed_from_the_send_and_from_its_headers_written(monkeypatch):
    """A server that answers 429 after 50 ms: both times hold it; the one from the headers written leaves out what
    this client took to send (here: its event loop stalled 100 ms before each request could go out)."""
    import asyncio
    import time

    from aiohttp import web

    from bench import slo_first_burst
    from bench.loadgen import RequestSpec
    from bench.slo_first_burst import _all
    from bench.systems import System, free_port
    real_send = slo_first_burst.send

    async def slow_client(*args, **kwargs):
        time.sleep(0.1)  # this client's own loop, busy before its request goes out
        return await real_send(*args, **kwargs)
    monkeypatch.setattr(slo_first_burst, "send", slow_client)

    async def scenario():
        async def refuse(request: web.Request) -> web.Response:
            await asyncio.sleep(0.05)
            return web.json_response({"error": {"message": "no"}}, status=429)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            written: list = []
            results = await _all(System("s", "m", None, port=port), [RequestSpec(({"role": "user", "content": "hi"},),
                                                                                 4)] * 3, [{}] * 3, 10,
                                 written_s=written)
            return results, written
        finally:
            await runner.cleanup()

    results, written = asyncio.run(scenario())
    assert [r.status for r in results] == [429] * 3 and len(written) == 3
    for result, from_headers in zip(results, written):
        assert 0.05 <= from_headers < result.e2e_s and result.e2e_s >= 0.15
