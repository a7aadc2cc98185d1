"""Registration jobs (registration_jobs.py) without a daemon: the guarded states, the bound on
jobs at once, cancels that wait for the clean-up, and one running job per name."""

from __future__ import annotations

import asyncio

import pytest

from clockwork_async.daemon.registration_jobs import Job, JobError, Jobs, JobState, job_status


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_job_goes_registering_profiling_ready() -> None:
    jobs = Jobs(max_concurrent=1)
    go = asyncio.Event()

    async def work(job: Job) -> None:
        job.move(JobState.PROFILING, 0)
        await go.wait()

    job = jobs.start("m", 1, work)
    assert job.state is JobState.REGISTERING
    await settle()
    assert job.state is JobState.PROFILING and job_status(job).state == "profiling"
    go.set()
    await job.done.wait()
    assert job.state is JobState.READY and not job.reason


async def test_at_most_max_concurrent_jobs_run_and_the_others_wait_their_turn() -> None:
    jobs = Jobs(max_concurrent=2)
    release = asyncio.Event()
    running: list[str] = []

    async def work(job: Job) -> None:
        running.append(job.name)
        await release.wait()

    started = [jobs.start(name, 1, work) for name in ("a", "b", "c")]
    await settle()
    assert running == ["a", "b"]  # c waits, registering
    assert started[2].state is JobState.REGISTERING
    release.set()
    for job in started:
        await job.done.wait()
    assert running == ["a", "b", "c"]


async def test_a_failure_is_named_and_kept_for_the_listing() -> None:
    jobs = Jobs(max_concurrent=1)

    async def work(job: Job) -> None:
        raise JobError("bad_model", "not an ONNX file")

    job = jobs.start("m", 3, work)
    await job.done.wait()
    assert (job.state, job.code, job.reason) == (JobState.FAILED, "bad_model", "not an ONNX file")
    status = job_status(job)
    assert (status.name, status.state, status.version, status.reason) == (
        "m",
        "failed",
        3,
        "not an ONNX file",
    )
    assert jobs.get("m") is job and jobs.running("m") is None


async def test_a_cancel_returns_after_the_clean_up_and_frees_the_name() -> None:
    jobs = Jobs(max_concurrent=1)
    cleaned: list[str] = []

    async def work(job: Job) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # clean-up that awaits
            cleaned.append(job.name)

    jobs.start("m", 1, work)
    await settle()
    with pytest.raises(RuntimeError, match="is running"):
        jobs.start("m", 2, work)
    job = await jobs.cancel("m", "cancelled by a client")
    assert cleaned == ["m"]
    assert (job.state, job.code, job.reason) == (
        JobState.CANCELLED,
        "cancelled",
        "cancelled by a client",
    )
    with pytest.raises(KeyError):
        await jobs.cancel("m", "again")
    again = jobs.start("m", 2, work)  # the name is free at once
    await jobs.cancel_all("stopping")
    assert again.state is JobState.CANCELLED and again.reason == "stopping"


async def test_a_cancel_of_a_job_waiting_for_a_slot_never_runs_it() -> None:
    jobs = Jobs(max_concurrent=1)
    ran: list[str] = []

    async def work(job: Job) -> None:
        ran.append(job.name)
        await asyncio.Event().wait()

    jobs.start("a", 1, work)
    jobs.start("b", 1, work)
    await settle()
    await jobs.cancel("b", "not wanted")
    await jobs.cancel_all("stopping")
    assert ran == ["a"]


def test_impossible_moves_raise() -> None:
    job = Job("m", 1, 0)
    job.move(JobState.READY, 1)
    with pytest.raises(RuntimeError, match="ready -> profiling"):
        job.move(JobState.PROFILING, 2)
