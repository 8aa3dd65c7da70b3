"""Admission control (kvstack.frontend.admission): taking a slot at once, and the queue behind the limit."""

from __future__ import annotations

import asyncio

import pytest

from kvstack.frontend.admission import AdmissionController, AdmissionRejected


def test_try_acquire_takes_a_free_slot_and_never_one_at_the_limit() -> None:
    admission = AdmissionController(max_in_flight=2)
    assert admission.try_acquire() and admission.try_acquire()
    assert not admission.try_acquire()
    assert admission.in_flight == 2
    admission.release()
    assert admission.try_acquire() and admission.in_flight == 2


def test_try_acquire_without_a_limit_always_takes_one() -> None:
    admission = AdmissionController(max_in_flight=0)
    assert all(admission.try_acquire() for _ in range(100))
    assert admission.in_flight == 100


async def test_try_acquire_does_not_overtake_a_queued_request() -> None:
    admission = AdmissionController(max_in_flight=1, queue_timeout=5.0)
    assert admission.try_acquire()
    queued = asyncio.ensure_future(admission.acquire())
    await asyncio.sleep(0)
    assert admission.queued == 1
    admission.release()  # the slot goes to the queued request...
    assert not admission.try_acquire()  # ...and not to a newcomer
    await asyncio.wait_for(queued, 1)
    assert admission.in_flight == 1


async def test_acquire_rejects_when_the_queue_is_full() -> None:
    admission = AdmissionController(max_in_flight=1, max_queue=0)
    assert admission.try_acquire()
    with pytest.raises(AdmissionRejected) as rejected:
        await admission.acquire()
    assert rejected.value.reason == "queue_full"
