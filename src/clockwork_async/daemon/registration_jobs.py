"""Registration jobs: each model added runs its registration as a background job that can be
watched (`JobState`, the reason of a failure), waited for and cancelled.

Invariants:
- A job moves through one guarded transition (`Job.move`): ``registering`` -> ``profiling``
  -> ``ready``, and from either of the first two to ``failed`` or ``cancelled``; the last
  three are final, and ``done`` is set exactly when a job reaches one of them.
- At most one job per name is running (not final); `Jobs.start` refuses a second.
- At most ``max_concurrent`` jobs run their work at once; the others wait, ``registering``,
  in the order they started (an `asyncio.Semaphore`, which is fair). Serving goes on beside
  them: the work registers on executors and profiles on lanes the core reserved.
- A cancelled job's work sees `asyncio.CancelledError` and cleans up before it ends (the
  driver unregisters everywhere, the service puts files back), so once ``done`` is set
  nothing of it is left and the name may be added again.
- The latest final job of each name is kept (at most `KEEP_FINISHED`, oldest dropped first)
  so that `models list` can say why a registration failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from clockwork_async.wire.messages import ModelStatus

log = logging.getLogger(__name__)

KEEP_FINISHED = 256  # final jobs remembered for `models list`


class JobState(StrEnum):
    REGISTERING = "registering"  # waiting for a slot, storing, registering on executors
    PROFILING = "profiling"  # measuring on executors (lanes reserved by the core)
    READY = "ready"  # served
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = frozenset({JobState.READY, JobState.FAILED, JobState.CANCELLED})
_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.REGISTERING: frozenset({JobState.PROFILING, *FINAL}),
    JobState.PROFILING: FINAL,
    JobState.READY: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class JobError(RuntimeError):
    """A job's work failed: ``code`` (an ApiCode value) and why, for the client."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


@dataclass(slots=True)
class Job:
    """One model's registration. ``code`` and ``reason`` say why it failed or was cancelled;
    ``version`` is the version it registers."""

    name: str
    version: int
    started_ns: int
    state: JobState = JobState.REGISTERING
    code: str = ""
    reason: str = ""
    ended_ns: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    cancel_reason: str = ""
    progress: str = ""  # what profiling runs now, e.g. "batch 4: run 3/12 on local-0"

    def move(self, new: JobState, now_ns: int, code: str = "", reason: str = "") -> None:
        """Go to ``new``. Raises RuntimeError for a move the table does not allow."""
        if new not in _MOVES[self.state]:
            raise RuntimeError(f"registration of {self.name!r}: {self.state} -> {new}")
        self.state = new
        if new in FINAL:
            self.code, self.reason, self.ended_ns = code, reason, now_ns
            self.done.set()

    @property
    def running(self) -> bool:
        return self.state not in FINAL

    def busy_message(self) -> str:
        """Why another add of the name is refused while this job runs."""
        return (
            f"model {self.name!r} version {self.version} is being registered ({self.state}); "
            "wait for it, or cancel it (`clockwork-async models cancel`)"
        )


def job_status(job: Job) -> ModelStatus:
    """A registration job as `list_models` shows it: its state, version and why."""
    so_far = f"{(time.monotonic_ns() - job.started_ns) / 1e9:.1f} s so far"
    reason = job.reason or (f"{job.progress}, {so_far}" if job.progress else so_far)
    return ModelStatus(job.name, job.name, job.state.value, version=job.version, reason=reason)


Work = Callable[[Job], Awaitable[None]]  # raises JobError (failed) or is cancelled


class Jobs:
    """The daemon's registration jobs, by model name."""

    def __init__(self, max_concurrent: int, now_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._slots = asyncio.Semaphore(max_concurrent)
        self._now_ns = now_ns
        self._jobs: dict[str, Job] = {}  # the latest job of each name

    def get(self, name: str) -> Job | None:
        """The latest job of ``name`` (running or final), if any."""
        return self._jobs.get(name)

    def running(self, name: str) -> Job | None:
        job = self._jobs.get(name)
        return job if job is not None and job.running else None

    def all(self) -> list[Job]:
        """The latest job of every name, by name."""
        return [self._jobs[name] for name in sorted(self._jobs)]

    def forget(self, name: str) -> None:
        """Drop the final job of ``name`` (its model was removed)."""
        job = self._jobs.get(name)
        if job is not None and not job.running:
            del self._jobs[name]

    def start(self, name: str, version: int, work: Work) -> Job:
        """Run ``work`` as the job of ``name`` once a slot is free. Raises RuntimeError if a
        job of ``name`` is running."""
        if self.running(name) is not None:
            raise RuntimeError(f"a registration of {name!r} is running")
        job = Job(name, version, self._now_ns())
        self._jobs.pop(name, None)
        self._jobs[name] = job  # newest last: the oldest final ones are dropped first
        self._trim()
        job.task = asyncio.get_running_loop().create_task(self._run(job, work))
        job.task.add_done_callback(lambda _: self._cancelled(job))
        return job

    def _cancelled(self, job: Job) -> None:
        """A task cancelled before it began never ran `_run`: its job ends here."""
        self._end(job, JobState.CANCELLED, "cancelled", job.cancel_reason or "cancelled")

    async def _run(self, job: Job, work: Work) -> None:
        try:
            async with self._slots:
                await work(job)
        except asyncio.CancelledError:
            self._cancelled(job)
            return  # the job ends here: its cancel is handled
        except JobError as error:
            self._end(job, JobState.FAILED, error.code, error.reason)
        except Exception as error:  # a bug: the job fails, the daemon goes on
            log.exception("registration of %r failed", job.name)
            self._end(job, JobState.FAILED, "internal", repr(error))
        else:
            self._end(job, JobState.READY)

    def _end(self, job: Job, state: JobState, code: str = "", reason: str = "") -> None:
        """Move a job that is still running to its final ``state`` (work that already made
        it ready, and then failed retiring the old version, stays ready)."""
        if job.running:
            job.move(state, self._now_ns(), code, reason)
            took_s = (job.ended_ns - job.started_ns) / 1e9
            why = f": {reason}" if reason else ""
            log.info(
                "registration of %r version %d %s after %.1f s%s",
                job.name,
                job.version,
                state,
                took_s,
                why,
            )

    async def cancel(self, name: str, reason: str) -> Job:
        """Cancel the running job of ``name`` and return it once it has cleaned up. Raises
        KeyError when none is running."""
        job = self.running(name)
        if job is None or job.task is None:
            raise KeyError(name)
        job.cancel_reason = reason
        job.task.cancel()
        await job.done.wait()
        return job

    async def cancel_all(self, reason: str) -> None:
        """Cancel every running job; return once all have cleaned up."""
        running = [job for job in self._jobs.values() if job.running]
        for job in running:
            job.cancel_reason = reason
            if job.task is not None:
                job.task.cancel()
        for job in running:
            with contextlib.suppress(asyncio.CancelledError):
                await job.done.wait()

    def _trim(self) -> None:
        finished = [name for name, job in self._jobs.items() if not job.running]
        for name in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._jobs[name]
