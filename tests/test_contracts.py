"""The shared contracts: message tags are unique and outcomes partition cleanly."""

from clockwork_async.core.outcomes import ACCEPTED_ENDINGS, REJECTED_AT_ARRIVAL, Outcome
from clockwork_async.wire.messages import MESSAGE_TYPES


def test_message_tags_are_unique_and_match_their_classes() -> None:
    assert all(cls.TAG == tag for tag, cls in MESSAGE_TYPES.items())
    assert len({cls.__name__ for cls in MESSAGE_TYPES.values()}) == len(MESSAGE_TYPES)


def test_every_outcome_is_either_a_rejection_or_an_accepted_ending() -> None:
    assert REJECTED_AT_ARRIVAL.isdisjoint(ACCEPTED_ENDINGS)
    assert REJECTED_AT_ARRIVAL | ACCEPTED_ENDINGS == set(Outcome)
    assert Outcome.INFEASIBLE.rejected_at_arrival
    assert not Outcome.LATE.rejected_at_arrival


async def test_async_tests_run_on_uvloop() -> None:
    import asyncio

    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
