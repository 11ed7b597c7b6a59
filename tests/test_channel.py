"""The stage channel: ordering, end of stream, backpressure and statistics."""

from __future__ import annotations

import asyncio

import pytest

from bmoe.pipeline.channel import Channel, ChannelClosed

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds


@pytest.mark.asyncio
async def test_items_arrive_in_order_and_close_ends_iteration() -> None:
    ch: Channel[int] = Channel()
    for i in range(5):
        ch.send_nowait(i)
    ch.close()
    assert [i async for i in ch] == [0, 1, 2, 3, 4]
    with pytest.raises(ChannelClosed):
        ch.send_nowait(9)


@pytest.mark.asyncio
async def test_bounded_send_waits_for_the_consumer() -> None:
    ch: Channel[int] = Channel(max_size=2)
    await ch.send(1)
    await ch.send(2)
    blocked = asyncio.create_task(ch.send(3))
    await asyncio.sleep(0)
    assert not blocked.done()
    assert await ch.receive() == 1
    await blocked
    stats = ch.statistics()
    assert (stats.queued, stats.sent, stats.max_queued) == (2, 3, 2)


@pytest.mark.asyncio
async def test_consumer_waits_for_a_late_producer() -> None:
    ch: Channel[str] = Channel()
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, ch.send_nowait, "late")
    loop.call_later(0.02, ch.close)
    assert [x async for x in ch] == ["late"]
