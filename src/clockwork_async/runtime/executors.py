"""The attached executors: one `LinkKeeper` and one `ExecutorRecord` each, owned here.

The pool is an edge of the dispatcher: it keeps links connected and tells its `ExecutorEvents`
sink (the dispatcher) when an executor joined or left; it never reads or writes the sink's
state.

Invariants: ``executor_joined`` is called when a link is up and its executor reconciled with
the controller's models; ``executor_left`` exactly once for each join, when that link goes down
or the executor is detached; a link that fails while joining was never joined and is not
reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from clockwork_async.runtime.executor_link import ExecutorLink, LinkConfig, LinkError
from clockwork_async.runtime.link_keeper import LinkKeeper
from clockwork_async.runtime.registration import ModelSource, reconcile
from clockwork_async.runtime.supervisor import Supervisor

log = logging.getLogger(__name__)

DownHook = Callable[[str, str], None]  # (executor id, reason)


class ExecutorEvents(Protocol):
    """Where joins and leaves go (the dispatcher)."""

    def executor_joined(
        self, executor_id: str, link: ExecutorLink, loaded: tuple[str, ...]
    ) -> None: ...

    def executor_left(self, executor_id: str, reason: str) -> None: ...


@dataclass(slots=True)
class ExecutorRecord:
    """One attached executor: its keeper, its joined link (None while not joined) and how
    often its process was restarted."""

    executor_id: str
    keeper: LinkKeeper | None = None
    link: ExecutorLink | None = None
    restarts: int = 0


class ExecutorPool:
    """Connects executors, keeps them connected, reports joins and leaves."""

    def __init__(
        self,
        config: LinkConfig,
        now_ns: Callable[[], int],
        *,
        known_models: Callable[[], Mapping[str, ModelSource]],
        events: ExecutorEvents,
    ) -> None:
        self.records: dict[str, ExecutorRecord] = {}
        self.on_executor_down: DownHook = lambda _id, _reason: None
        self.closed = False
        self._config = config
        self._now_ns = now_ns
        self._known_models = known_models
        self._events = events

    async def attach(self, executor_id: str, address: str, *, token: str = "") -> None:
        """Connect and keep connected; returns once it joined. Raises ValueError for a
        duplicate id, LinkError if the first connection failed (it is then forgotten)."""
        if executor_id in self.records:
            raise ValueError(f"executor {executor_id!r} is already attached")
        record = self.records[executor_id] = ExecutorRecord(executor_id)
        record.keeper = LinkKeeper(
            executor_id,
            address,
            on_up=partial(self._up, record),
            on_down=partial(self._down, record),
            token=token,
            config=self._config,
            now_ns=self._now_ns,
        )
        try:
            await record.keeper.wait_first()
        except LinkError:
            del self.records[executor_id]
            await record.keeper.close()
            raise

    async def detach(self, executor_id: str) -> None:
        """Stop using an executor (reported as left, without ``on_executor_down``).
        Raises KeyError."""
        record = self.records.pop(executor_id)
        if record.link is not None:
            self._down(record, record.link, "detached", notify=False)
        if record.keeper is not None:
            await record.keeper.close()

    async def attach_supervised(self, supervisor: Supervisor) -> None:
        """Attach every executor of a started supervisor: a restarted process is reconnected at
        once, and one whose link goes down is killed so that the supervisor restarts it (a hung
        executor comes back too). Raises LinkError like `attach`."""
        supervisor.on_ready = self.restarted
        forward = self.on_executor_down

        def down(executor_id: str, reason: str) -> None:
            forward(executor_id, reason)
            if executor_id in supervisor.children:
                supervisor.kill(executor_id, f"its link went down: {reason}")

        self.on_executor_down = down
        for name, child in supervisor.children.items():
            await self.attach(name, child.address, token=child.spec.token)

    def restarted(self, executor_id: str, address: str) -> None:
        """A local executor's process was restarted, ready at ``address``: reconnect now."""
        record = self.records.get(executor_id)
        if record is not None and record.keeper is not None:
            record.restarts += 1
            record.keeper.poke(address)

    def link_for(self, executor_id: str) -> ExecutorLink | None:
        """The joined link of ``executor_id`` (None if unknown or not joined)."""
        record = self.records.get(executor_id)
        return record.link if record is not None else None

    def joined_links(self) -> list[ExecutorLink]:
        return [r.link for r in self.records.values() if r.link is not None and r.link.up]

    async def close(self) -> None:
        """Close every link (nothing is reported as left)."""
        self.closed = True
        for record in list(self.records.values()):
            if record.keeper is not None:
                await record.keeper.close()

    async def _up(self, record: ExecutorRecord, link: ExecutorLink) -> None:
        loaded = await reconcile(link, self._known_models())
        if self.closed or not link.up:
            raise LinkError(f"executor {record.executor_id} went away while joining")
        record.link = link
        info = link.info
        log.info(
            "executor %s joined (%s, %d pages)", record.executor_id, info.kind, info.pages_total
        )
        self._events.executor_joined(record.executor_id, link, loaded)

    def _down(
        self, record: ExecutorRecord, link: ExecutorLink, reason: str, *, notify: bool = True
    ) -> None:
        if record.link is not link:
            return  # never joined (it failed while joining), or already reported
        record.link = None
        self._events.executor_left(record.executor_id, reason)
        if notify:
            try:
                self.on_executor_down(record.executor_id, reason)
            except Exception:
                log.exception("on_executor_down raised")
