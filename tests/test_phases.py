"""The start-up phases a run reports in summary.json: the first time each is reached, from the process's start."""

from __future__ import annotations

import time

import pytest

from orchestrator import phases
from orchestrator.app import console
from tests.app.test_closing_lines import _summary as closing_lines_summary

pytestmark = pytest.mark.spec


def test_a_phase_keeps_its_first_time_and_a_restart_forgets_them():
  phases.restart()
  started = phases.process_started_at()
  assert started is not None and started <= time.time()
  phases.mark("trainer_built", started + 2.0)
  phases.mark("imports", started + 0.5)
  phases.mark("trainer_built", started + 9.0)  # later: kept at its first time
  assert phases.seconds_from_start() == pytest.approx({"imports": 0.5, "trainer_built": 2.0}, abs=0.02)
  assert list(phases.seconds_from_start()) == ["imports", "trainer_built"]  # in the phases' order
  with pytest.raises(ValueError, match="'compile' is not one of imports"):
    phases.mark("compile")
  phases.restart()
  assert phases.seconds_from_start() == {}


def test_the_closing_lines_name_each_phase():
  line = next(l for l in console.format_summary(_summary({"imports": 2.16, "first_update": 63.0})).splitlines()
              if l.startswith("start-up"))
  assert line == "start-up, seconds from the process's start: imports 2.2, first update 63.0"
  # in the order they came: a new live run samples while its trainer is built
  line = next(l for l in console.format_summary(_summary({"trainer_built": 9.0, "first_rollout": 5.0})).splitlines()
              if l.startswith("start-up"))
  assert line == "start-up, seconds from the process's start: first rollouts 5.0, trainer built 9.0"
  assert "start-up" not in console.format_summary(_summary({}))


def _summary(startup):
  return closing_lines_summary().replace(run={"startup_s": startup} if startup else {})
