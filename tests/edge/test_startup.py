"""The gateway's start-up: its ready line, once, when /health turns 200."""

import asyncio
import logging
import types

from edge.launch.local import announce_ready as _announce_ready


def stub_gateway():
    pool = types.SimpleNamespace(num_ready=0, workers={"prefill-0": None, "prefill-1": None})
    return types.SimpleNamespace(ready=False, embedding_only=False, pool=pool)


def test_the_gateway_logs_once_when_it_becomes_ready(caplog):
    gateway = stub_gateway()
    pool = gateway.pool

    async def scenario():
        announced = asyncio.create_task(_announce_ready(gateway, poll_s=0.01))
        await asyncio.sleep(0.05)
        assert not announced.done()  # not ready yet: nothing said
        gateway.ready, pool.num_ready = True, 1
        await asyncio.wait_for(announced, 5)

    with caplog.at_level(logging.INFO, logger="edge.launch.local"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready:")]
    assert len(lines) == 1
    assert lines[0].startswith("ready: the decode engine and 1 of 2 prefill workers connected, ")
    assert lines[0].endswith(" s after the gateway process started")

