"""Fixtures shared by this folder's test files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def schedule_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[float], list[int]]]:
    """Every registered schedule trained once (test_v_schedules.train_every_schedule: one spawn of 4 ranks and one
    of 1), read by test_v_schedules and by test_trainer's test_schedules_do_not_change_the_math."""
    from tests.moe.train.test_v_schedules import train_every_schedule

    return train_every_schedule(tmp_path_factory.mktemp("schedules"))
