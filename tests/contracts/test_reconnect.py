"""The one reconnect loop of the three control links: failed tries back off, doubling up to the longest wait; a
connection that held resets the backoff; the connection is closed whenever its holder returns or is cancelled;
an error no try can fail with is a bug and ends the loop."""

from __future__ import annotations

import asyncio

import pytest

from contracts.framing import PeerRefusedError
from contracts.reconnect import RETRY_FIRST_S, RETRY_LONGEST_S, RetryDelay, stay_connected


class RecordedDelay(RetryDelay):
    """The real backoff at a thousandth of the time, each wait recorded."""

    def __init__(self) -> None:
        super().__init__(RETRY_FIRST_S / 1000, RETRY_LONGEST_S / 1000)
        self.waits: list[float] = []

    async def wait(self, failed: bool = False) -> None:
        self.waits.append(self.delay * 1000)
        await super().wait(failed)


class FakeWriter:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_failed_tries_back_off_and_a_connection_that_held_resets_it():
    outcomes = [OSError("no socket"), PeerRefusedError("wrong secret"), TimeoutError(), OSError(), OSError(),
                OSError(), "connect", LookupError("no Ray actor"), "connect"]
    writers, failures, retry = [], [], RecordedDelay()

    async def connect():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        writers.append(FakeWriter())
        return None, writers[-1]

    async def hold(streams):
        if not outcomes:
            raise asyncio.CancelledError  # as at shutdown, inside the holder
        assert not streams[1].closed

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(stay_connected(connect, hold, failures.append, retry))
    assert [type(err) for err in failures] == [OSError, PeerRefusedError, TimeoutError, OSError, OSError, OSError,
                                               LookupError]
    doubling = [min(RETRY_LONGEST_S, RETRY_FIRST_S * 2 ** i) for i in range(6)]
    expected = [*doubling, RETRY_FIRST_S, RETRY_FIRST_S]  # after the drop, and after the next failure
    assert retry.waits == pytest.approx(expected)
    assert all(writer.closed for writer in writers)  # a holder that returned, and one that was cancelled


def test_an_error_no_try_can_fail_with_ends_the_loop():
    async def connect():
        raise ValueError("a bug")

    with pytest.raises(ValueError):
        asyncio.run(stay_connected(connect, None, lambda err: None, RecordedDelay()))
