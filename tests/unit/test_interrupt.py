"""StepInterrupt, the channel from StepEngine.abort into a step in flight: no engine, no
thread but the test's."""

from __future__ import annotations

import threading

import pytest

from stagemesh.shared.engine.interrupt import Interruptible, StepInterrupt, StepInterrupted


def test_requested_only_once_every_request_of_the_armed_batch_is_cancelled() -> None:
    interrupt = StepInterrupt()
    interrupt.arm(["a", "b"])
    interrupt.cancel("a")
    assert not interrupt.requested()
    interrupt.check()  # someone still wants the step: no raise
    interrupt.cancel("b")
    assert interrupt.requested()
    with pytest.raises(StepInterrupted):
        interrupt.check()
    interrupt.disarm()
    assert not interrupt.requested()


def test_nothing_is_requested_while_disarmed() -> None:
    interrupt = StepInterrupt()
    assert not interrupt.requested()
    interrupt.cancel("a")
    assert not interrupt.requested()
    interrupt.cancel_all()
    assert not interrupt.requested()


def test_a_cancel_between_steps_counts_for_the_next_armed_batch() -> None:
    interrupt = StepInterrupt()
    interrupt.cancel("a")  # after the last disarm, before the next arm
    interrupt.arm(["a"])
    assert interrupt.requested()


def test_a_cancel_between_steps_of_an_id_outside_the_next_batch_is_dropped() -> None:
    interrupt = StepInterrupt()
    interrupt.cancel("gone")
    interrupt.arm(["a"])
    interrupt.cancel("a")
    assert interrupt.requested()
    interrupt.arm(["gone", "b"])  # a later batch does not inherit cancels from the first
    assert not interrupt.requested()


def test_disarm_forgets_the_cancels_of_the_step_that_ended() -> None:
    interrupt = StepInterrupt()
    interrupt.arm(["a", "b"])
    interrupt.cancel("a")
    interrupt.cancel("c")  # not in the batch while armed: the control queue handles it
    interrupt.disarm()
    interrupt.arm(["a", "c"])
    assert not interrupt.requested()
    interrupt.cancel("c")
    assert not interrupt.requested()  # a's cancel belonged to the step that ended


def test_cancel_all_stops_the_armed_step_and_the_next_one_until_disarmed() -> None:
    interrupt = StepInterrupt()
    interrupt.arm(["a"])
    interrupt.cancel_all()
    assert interrupt.requested()
    interrupt.disarm()
    interrupt.cancel_all()  # between steps: the next step stops at once
    interrupt.arm(["b"])
    assert interrupt.requested()


def test_cancels_kept_between_steps_are_bounded() -> None:
    def flooded() -> StepInterrupt:
        interrupt = StepInterrupt()
        for n in range(StepInterrupt.MAX_KEPT + 10):
            interrupt.cancel(f"r{n}")
        return interrupt

    first, over = flooded(), flooded()
    first.arm(["r0"])
    assert first.requested()
    over.arm([f"r{StepInterrupt.MAX_KEPT + 5}"])  # over the bound: not kept
    assert not over.requested()


def test_cancel_from_another_thread_is_seen_by_the_stepping_thread() -> None:
    interrupt = StepInterrupt()
    interrupt.arm(["a"])
    canceller = threading.Thread(target=interrupt.cancel, args=("a",))
    canceller.start()
    canceller.join()
    with pytest.raises(StepInterrupted):
        interrupt.check()


def test_an_adapter_with_bind_interrupt_is_interruptible() -> None:
    class Stoppable:
        def bind_interrupt(self, interrupt: StepInterrupt) -> None:
            self.interrupt = interrupt

    assert isinstance(Stoppable(), Interruptible)
    assert not isinstance(object(), Interruptible)
