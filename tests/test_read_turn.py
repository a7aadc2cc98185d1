"""Read turns (read_turn.py, `Connection`'s ``read_turn_ns``): one connection's messages get a
budget of each loop iteration, then the loop's other work comes first; and the backlog a
spent turn leaves, which the API's door takes as a frame's wait. Clocks are hand-moved; the
connection case checks the order of events on a real loop, never a duration."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from clockwork_async.connection import Connection, ConnectionClosed
from clockwork_async.endpoints import open_connection, start_server
from clockwork_async.read_turn import ReadTurn
from clockwork_async.wire.messages import Message, Ping


async def test_a_spent_turn_ends_in_the_next_iteration_and_marks_what_it_left_unread() -> None:
    now, unread, ended = [1_000], [0], []
    turn = ReadTurn(10, lambda: ended.append(now[0]), lambda: unread[0], clock=lambda: now[0])
    turn.received(300)
    assert not turn.over()  # the first call starts this iteration's turn
    now[0] += 4
    assert not turn.over()
    now[0] += 6  # 10 ns since it started: spent
    assert turn.over() and turn.spent
    unread[0] = 500  # still in the socket: the stream up to 800 bytes had arrived by now
    await asyncio.sleep(0)  # the next iteration
    assert ended == [1_010] and not turn.spent
    now[0] += 20
    turn.received(400)  # a frame decoded now ends within the first 700 bytes: in the socket
    assert turn.backlog_ns() == 20  # at 1,010 already, so it waited at least 20 ns
    turn.received(100)  # 800: still within the mark
    assert turn.backlog_ns() == 20
    turn.received(1)  # past the mark: no sign that this one waited
    assert turn.backlog_ns() == 0


async def test_a_turn_that_is_not_spent_or_leaves_nothing_unread_marks_nothing() -> None:
    now, unread, ended = [0], [64], []
    turn = ReadTurn(5, lambda: ended.append(now[0]), lambda: unread[0], clock=lambda: now[0])
    turn.over()
    now[0] += 4  # under budget: bytes in the socket are read in this same iteration
    await asyncio.sleep(0)
    assert ended == [] and turn.backlog_ns() == 0
    turn.over()
    now[0] += 5
    assert turn.over()
    unread[0] = 0
    await asyncio.sleep(0)
    assert ended == [9] and turn.backlog_ns() == 0


def test_a_turn_needs_a_budget() -> None:
    with pytest.raises(ValueError, match="budget"):
        ReadTurn(0, lambda: None, lambda: 0)


async def test_a_connections_turn_lets_the_loop_run_between_its_messages(tmp_path: Path) -> None:
    """A budget of 1 ns: one message per iteration, so a callback queued by the first one runs
    before the third is handed over (without turns all five go in one read callback)."""
    events: list[str] = []
    done = asyncio.Event()

    def handle(message: Message) -> None:
        assert isinstance(message, Ping)
        events.append(f"ping {message.seq}")
        if message.seq == 0:
            asyncio.get_running_loop().call_soon(events.append, "loop")
        if message.seq == 4:
            done.set()

    async def serve(connection: Connection) -> None:
        await connection.dispatch(handle)

    address = f"unix:{tmp_path / 'turns.sock'}"
    server = await start_server(serve, address, read_turn_ns=1)
    client = await open_connection(address)
    for seq in range(5):
        client.send(Ping(seq, 0))
    client.flush()
    await asyncio.wait_for(done.wait(), 10)
    assert events.index("loop") < events.index("ping 2")
    assert [e for e in events if e != "loop"] == [f"ping {i}" for i in range(5)]
    client.close()
    await client.wait_closed()
    server.close()
    await server.wait_closed()


async def test_dispatch_ends_after_the_messages_a_turn_left_when_the_peer_closed(
    tmp_path: Path,
) -> None:
    """The peer sends and closes at once; turns hand its messages over one an iteration, and
    `dispatch` still ends (ConnectionClosed) once the last is out. (The case where it did not:
    the peer's end read while replies to it were paused, tests/hostile/test_slow_clients.py.)"""
    got: list[int] = []
    ended = asyncio.get_running_loop().create_future()

    async def serve(connection: Connection) -> None:
        try:
            await connection.dispatch(lambda m: got.append(m.seq))  # type: ignore[attr-defined]
        except ConnectionClosed as closed:
            ended.set_result(closed)

    address = f"unix:{tmp_path / 'closing.sock'}"
    server = await start_server(serve, address, read_turn_ns=1)
    client = await open_connection(address)
    for seq in range(20):
        client.send(Ping(seq, 0))
    client.close()
    await client.wait_closed()
    assert isinstance(await asyncio.wait_for(ended, 10), ConnectionClosed)
    assert got == list(range(20))
    server.close()
    await server.wait_closed()
