"""ExecutorLink and LinkKeeper against an in-process fake executor on a real Unix socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from clockwork_async.connection import Connection
from clockwork_async.endpoints import start_server
from clockwork_async.runtime import executor_link
from clockwork_async.runtime.backoff import BackoffConfig
from clockwork_async.runtime.executor_link import (
    ExecutorLink,
    LinkConfig,
    LinkDown,
    LinkError,
    LinkState,
)
from clockwork_async.runtime.link_keeper import LinkKeeper
from clockwork_async.wire.messages import (
    PROTOCOL_VERSION,
    ActionResult,
    ExecutorInfo,
    GetState,
    Hello,
    Ping,
    Pong,
    State,
)

FAST = LinkConfig(
    heartbeat_interval_ms=20.0,
    heartbeat_miss_limit=7,  # down after 0.15 s of silence
    sync_samples=4,
    reconnect_backoff=BackoffConfig(initial_s=0.01, max_s=0.05, healthy_s=1.0),
)


@dataclass
class FakeExecutor:
    """Answers the handshake, pings (unless muted) and GetState; can hang up."""

    role: str = "executor"
    muted: bool = False
    state_delay_s: float = 0.0
    connections: list[Connection] = field(default_factory=list)

    async def handle(self, conn: Connection) -> None:
        self.connections.append(conn)
        await conn.recv()  # the controller's Hello
        conn.send(Hello(PROTOCOL_VERSION, self.role, "fake"))
        conn.send(ExecutorInfo("fake", "simulated", "sim", "sim", ("load", "execute"), 1, 8, 8, 0))
        async for message in conn:
            if isinstance(message, Ping) and not self.muted:
                conn.send(Pong(message.seq, message.sent_ns, message.sent_ns + 5))
            elif isinstance(message, GetState):
                await asyncio.sleep(self.state_delay_s)
                conn.send(State(message.action_id, 1, 8, 8, (), ()))

    def hang_up(self) -> None:
        for conn in self.connections:
            conn.abort()


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[tuple[FakeExecutor, str]]:
    executor = FakeExecutor()
    address = f"unix:{tmp_path / 'fake.sock'}"
    server = await start_server(executor.handle, address)
    try:
        yield executor, address
    finally:
        executor.hang_up()
        server.close()
        await server.wait_closed()


async def test_open_handshakes_and_syncs_the_clock(fake: tuple[FakeExecutor, str]) -> None:
    _, address = fake
    link = await ExecutorLink.open("e", address, config=FAST)
    try:
        assert link.state is LinkState.UP
        assert link.info.kind == "sim" and link.info.pages_total == 8
        assert link.clock.sample_count == FAST.sync_samples
        # The fake answers sent_ns + 5: the NTP estimate is exactly 5 - rtt // 2.
        assert link.clock.offset_ns == 5 - link.clock.best.rtt_ns // 2
        reply = await link.call(GetState(link.next_call_id()), link.next_call_id() - 1)
        assert isinstance(reply, State)
    finally:
        link.close()
        await link.wait_closed()


async def test_a_peer_that_is_not_an_executor_is_refused(fake: tuple[FakeExecutor, str]) -> None:
    executor, address = fake
    executor.role = "client"
    with pytest.raises(LinkError, match="not an executor"):
        await ExecutorLink.open("e", address, config=FAST)


async def test_silence_takes_the_link_down_once(fake: tuple[FakeExecutor, str]) -> None:
    executor, address = fake
    executor.state_delay_s = 10.0  # a call that will never be answered in time
    link = await ExecutorLink.open("e", address, config=FAST)
    downs: list[str] = []
    link.on_down = lambda _link, reason: downs.append(reason)
    executor.muted = True
    call_id = link.next_call_id()
    with pytest.raises(LinkDown):
        await link.call(GetState(call_id), call_id)
    await link.wait_closed()
    assert len(downs) == 1 and "no heartbeat" in downs[0]
    assert link.state is LinkState.DOWN
    with pytest.raises(LinkDown):
        link.send_action(GetState(1), 1, lambda _m: None)


async def test_a_closed_socket_takes_the_link_down(fake: tuple[FakeExecutor, str]) -> None:
    executor, address = fake
    link = await ExecutorLink.open("e", address, config=FAST)
    gone = asyncio.Event()
    link.on_down = lambda _link, _reason: gone.set()
    executor.hang_up()
    await asyncio.wait_for(gone.wait(), 5.0)
    assert "closed" in link.down_reason
    await link.wait_closed()


async def test_unanswered_actions_are_dropped_not_answered(fake: tuple[FakeExecutor, str]) -> None:
    executor, address = fake
    link = await ExecutorLink.open("e", address, config=FAST)
    answered: list[object] = []
    link.send_action(ActionResult(42), 42, answered.append)  # the fake never answers this
    assert link.outstanding == 1
    executor.hang_up()
    await link.wait_closed()
    assert link.outstanding == 0 and answered == []


async def test_keeper_reconnects_after_the_link_drops(fake: tuple[FakeExecutor, str]) -> None:
    executor, address = fake
    ups: list[ExecutorLink] = []
    downs: list[str] = []

    async def on_up(link: ExecutorLink) -> None:
        ups.append(link)

    keeper = LinkKeeper(
        "e", address, on_up=on_up, on_down=lambda _l, r: downs.append(r), config=FAST
    )
    try:
        await keeper.wait_first()
        assert keeper.connects == 1
        executor.hang_up()
        for _ in range(250):
            if keeper.connects == 2:
                break
            await asyncio.sleep(0.02)
        assert keeper.connects == 2 and len(ups) == 2 and len(downs) == 1
        assert ups[1] is not ups[0] and ups[1].up
    finally:
        await keeper.close()
    assert keeper.link is not None and keeper.link.state is LinkState.CLOSED


async def test_keeper_first_failure_is_raised(tmp_path: Path) -> None:
    async def on_up(link: ExecutorLink) -> None:
        raise AssertionError("never up")

    keeper = LinkKeeper(
        "e", f"unix:{tmp_path / 'none.sock'}", on_up=on_up, on_down=lambda _l, _r: None, config=FAST
    )
    with pytest.raises(LinkError, match="cannot connect"):
        await keeper.wait_first()
    await keeper.close()


async def test_a_late_reply_to_an_abandoned_call_is_expected_and_an_unknown_one_warns(
    fake: tuple[FakeExecutor, str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executor, address = fake
    executor.state_delay_s = 0.05  # each GetState answered this late, one after the other
    monkeypatch.setattr(executor_link, "ABANDONED_REMEMBERED", 2)
    link = await ExecutorLink.open("e", address, config=FAST)
    caplog.set_level(logging.DEBUG, logger=executor_link.__name__)
    try:
        ids = [link.next_call_id() for _ in range(4)]
        cancelled = asyncio.ensure_future(link.call(GetState(ids[0]), ids[0]))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # as a cancelled registration's call is
        for call_id in ids[1:]:
            with pytest.raises(TimeoutError):
                await link.call(GetState(call_id), call_id, timeout_s=0.001)
        executor.connections[-1].send(State(12345, 1, 8, 8, (), ()))  # never sent by us
        reply = await link.call(GetState(link.next_call_id()), link.next_call_id() - 1)
        assert isinstance(reply, State)  # every earlier reply has come by now
    finally:
        link.close()
        await link.wait_closed()
    records = [r for r in caplog.records if "action" in r.getMessage()]
    expected = {(logging.DEBUG, f"executor e: reply to abandoned action {i}") for i in ids[2:]}
    unknown = {(logging.WARNING, f"executor e: reply to unknown action {i}") for i in ids[:2]}
    unknown.add((logging.WARNING, "executor e: reply to unknown action 12345"))
    # Four abandoned, two remembered: the two oldest are forgotten, so their replies warn.
    assert {(r.levelno, r.getMessage()) for r in records} == expected | unknown
