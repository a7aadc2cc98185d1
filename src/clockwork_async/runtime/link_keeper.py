"""Keeping one executor connected: `LinkKeeper` opens `ExecutorLink`s with backoff between
failures, reports each one up and down, and reconnects at once when poked (a local executor
restarted).

Invariants: at most one link at a time; ``on_up`` runs before a link counts as up (a failure in
it counts as a failed attempt); ``on_down`` once per link that was up; the first attempt's
failure is the caller's (`wait_first` raises it) and stops the keeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from clockwork_async.runtime.backoff import Backoff
from clockwork_async.runtime.executor_link import ExecutorLink, LinkConfig, LinkDown, LinkError

log = logging.getLogger(__name__)


OnUp = Callable[[ExecutorLink], Awaitable[None]]
OnDown = Callable[[ExecutorLink, str], None]


class LinkKeeper:
    """Keeps one executor connected: open a link, report it up, wait until it is down, back
    off, reconnect. ``on_up`` runs before the link counts as up (the driver registers models
    there); a failure in it counts as a failed attempt."""

    def __init__(
        self,
        executor_id: str,
        address: str,
        *,
        on_up: OnUp,
        on_down: OnDown,
        token: str = "",
        config: LinkConfig | None = None,
        now_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.executor_id = executor_id
        self.address = address
        self.config = config or LinkConfig()
        self.link: ExecutorLink | None = None
        self.connects = 0  # links brought up
        self.last_error = ""
        self._token = token
        self._on_up = on_up
        self._on_down = on_down
        self._now_ns = now_ns
        self._backoff = Backoff(self.config.reconnect_backoff)
        self._poked = asyncio.Event()
        self._first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closed = False
        self._task = asyncio.create_task(self._run(), name=f"link-keeper-{executor_id}")

    async def wait_first(self) -> None:
        """Wait for the first link to be up. Raises LinkError if the first attempt failed (the
        keeper then stops)."""
        await asyncio.shield(self._first)

    def poke(self, address: str | None = None) -> None:
        """Reconnect now instead of after the backoff (a local executor was restarted),
        optionally at a new address. A link that is up stays as it is."""
        if address is not None:
            self.address = address
        self._poked.set()

    async def close(self) -> None:
        """Stop reconnecting and close the link (without ``on_down``)."""
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self.link is not None:
            self.link.close()
            await self.link.wait_closed()
        if not self._first.done():
            self._first.set_exception(LinkDown(f"executor {self.executor_id}: closed"))
            self._first.exception()  # retrieved: nobody has to wait for it

    async def _run(self) -> None:
        while not self._closed:
            try:
                link = await self._attempt()
            except LinkError as error:
                self.last_error = str(error)
                first = self._backoff.consecutive_failures == 0
                log.log(logging.WARNING if first else logging.INFO, "%s", error)
                if not self._first.done():
                    self._first.set_exception(error)
                    return
                await self._pause(self._backoff.failed(self._now_s()))
                continue
            if link is not None:
                await self._serve(link)
                await self._pause(self._backoff.failed(self._now_s()))

    async def _attempt(self) -> ExecutorLink | None:
        """Open a link; None if poked meanwhile (retry at once). Raises LinkError."""
        self._poked.clear()
        opening = asyncio.create_task(
            ExecutorLink.open(
                self.executor_id,
                self.address,
                token=self._token,
                config=self.config,
                now_ns=self._now_ns,
            )
        )
        poked = asyncio.create_task(self._poked.wait())
        try:
            done, _ = await asyncio.wait({opening, poked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            poked.cancel()
            if not opening.done():
                opening.cancel()
                with contextlib.suppress(asyncio.CancelledError, LinkError):
                    await opening
        return opening.result() if opening in done else None

    async def _serve(self, link: ExecutorLink) -> None:
        """Report ``link`` up, then wait until it is down."""
        down = asyncio.Event()

        def went_down(gone: ExecutorLink, reason: str) -> None:
            down.set()
            self._on_down(gone, reason)

        link.on_down = went_down
        self.link = link
        try:
            await self._on_up(link)
        except (LinkError, TimeoutError) as error:
            self.last_error = f"executor {self.executor_id}: joining failed: {error}"
            log.warning("%s", self.last_error)
            link.close()
            if not self._first.done():
                self._first.set_exception(LinkError(self.last_error))
                self._closed = True
            return
        self.connects += 1
        self._backoff.started(self._now_s())
        if not self._first.done():
            self._first.set_result(None)
        await down.wait()
        await link.wait_closed()

    async def _pause(self, delay_s: float) -> None:
        """Sleep ``delay_s`` unless poked first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._poked.wait(), delay_s)

    def _now_s(self) -> float:
        return self._now_ns() / 1e9
