"""Retiring served models: a version that is no longer routed to (replaced by a newer one, or
unloaded) is unregistered once the requests already routed to it are answered.

Invariants: the caller has taken the models out of the routes first, so no request joins
their queues while this waits; queued requests are waited for here (at most
`RETIRE_TIMEOUT_S`), running ones finish in `Driver.unregister_model`; the outcome listener
is attached only while waiting, never on every request's way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import MutableMapping

from clockwork_async.runtime.driver import Driver, RegisteredModel

log = logging.getLogger("clockwork_async.daemon.admin")

RETIRE_TIMEOUT_S = 30.0  # a retired version's queued requests may take this long to finish


async def retire(
    driver: Driver, aliases: MutableMapping[str, str], models: list[RegisteredModel]
) -> None:
    """Unregister ``models`` once the requests routed to them are answered: their queued ones
    here, their running ones in `Driver.unregister_model`. ``aliases`` are the metrics'
    instance aliases (dropped with each model)."""
    if not models:
        return
    names = {model.name for model in models}
    answered = asyncio.Event()

    def on_outcome(model: str, *_: object) -> None:
        if model in names:
            answered.set()

    listeners = driver.outcome_listeners
    listeners.append(on_outcome)  # only while retiring: not on every request's way
    try:
        async with asyncio.timeout(RETIRE_TIMEOUT_S):
            while _queued(driver, names):
                answered.clear()
                await answered.wait()
    except TimeoutError:
        log.warning("retired %s: queued requests left after %.0f s", names, RETIRE_TIMEOUT_S)
    finally:
        listeners.remove(on_outcome)
    for model in models:
        await drop(driver, aliases, model.name)


def _queued(driver: Driver, names: set[str]) -> int:
    return sum(m.queued for m in driver.snapshot().models if m.name in names)


async def drop(driver: Driver, aliases: MutableMapping[str, str], target: str) -> None:
    """Unregister ``target`` now (queued requests are answered ``unknown_model``)."""
    aliases.pop(target, None)
    with contextlib.suppress(KeyError):  # already gone
        await driver.unregister_model(target)
