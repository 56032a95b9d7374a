"""The timing budget: a token bucket of timing seconds that refills at its share of wall time."""

from __future__ import annotations

import pytest

from sparseconv.tune.budget import TimingBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_allows_its_burst_then_refills_at_its_share_up_to_the_burst():
    clock = Clock()
    budget = TimingBudget(share=0.1, burst=1.0, clock=clock)
    assert budget.allows()
    budget.spend(0.6)
    assert budget.allows()  # 0.4 s left
    budget.spend(0.9)  # a sweep may overrun: 0.5 s below empty
    assert not budget.allows()
    clock.now += 4.9  # refilled by 0.49 s: still below empty
    assert not budget.allows()
    clock.now += 0.2
    assert budget.allows()
    assert budget.spent_s == pytest.approx(1.5)
    clock.now += 1000.0  # a quiet spell refills the burst, no more
    budget.spend(1.0)
    assert not budget.allows()


def test_a_waived_stretch_times_whatever_the_level_and_charges_nothing():
    clock = Clock()
    budget = TimingBudget(share=0.1, burst=1.0, clock=clock)
    budget.spend(1.5)
    assert not budget.allows()
    with budget.waived():
        assert budget.allows()
        budget.spend(3.0)  # (a graph's capture tuning its layers)
    assert not budget.allows()
    clock.now += 5.1  # the level is where the waived stretch found it: 0.5 s below empty, refilled by 0.51
    assert budget.allows()
    assert budget.spent_s == pytest.approx(4.5)
