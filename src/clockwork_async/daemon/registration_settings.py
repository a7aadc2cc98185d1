"""How the daemon registers repository models on its executors (`Registration`): where the
profile cache is and what it is keyed by, the host-memory budget for weights, what executors
are told to load, and how many registrations run at once.

Invariants: weights are counted once per content hash (instances and identical files share
host memory); a profile that cannot be cached is logged, never fatal. Every method but
`check_budget` blocks on the cache's files (call them from a worker thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from clockwork_async.api.service import ServiceError
from clockwork_async.models.profile_cache import ProfileCache
from clockwork_async.models.repository import ModelEntry
from clockwork_async.runtime.profiler import RegistrationProfile
from clockwork_async.wire.messages import ApiCode

log = logging.getLogger("clockwork_async.daemon.admin")


@dataclass(frozen=True, slots=True)
class Registration:
    """How the daemon registers repository models on its executors."""

    cache: ProfileCache
    machine_for: Callable[[ModelEntry], str]  # profile cache key: CPU, backend, runtime, ...
    budget_bytes: int  # host weights, one copy per content hash
    path_for: Callable[[ModelEntry], str]  # what executors are told to register
    max_concurrent: int = 2  # registration jobs at once (profiler.max_concurrent)

    def check_budget(
        self, served: Mapping[str, ModelEntry], name: str, sha256: str, size_bytes: int
    ) -> None:
        """Raises ServiceError(unavailable) if serving ``name`` (this file) beside the other
        ``served`` folders would put weights over the host budget."""
        by_hash = {e.sha256: e.size_bytes for n, e in served.items() if n != name}
        by_hash[sha256] = size_bytes
        total_bytes = sum(by_hash.values())
        if total_bytes > self.budget_bytes:
            raise ServiceError(
                ApiCode.UNAVAILABLE,
                f"model {name!r} ({size_bytes} bytes) would put host weights at {total_bytes} "
                f"bytes, over the budget of {self.budget_bytes} (repository.weights_budget_bytes)",
            )

    def cached_profile(self, entry: ModelEntry) -> RegistrationProfile | None:
        machine = self.machine_for(entry)
        return self.cache.get(entry.profile_key, machine, RegistrationProfile.from_json)

    def store_profile(self, entry: ModelEntry, profile: RegistrationProfile) -> None:
        machine = self.machine_for(entry)
        try:
            self.cache.put(entry.profile_key, machine, profile.to_json())
        except OSError as error:
            log.warning("profile of %r not cached: %s", entry.name, error)
