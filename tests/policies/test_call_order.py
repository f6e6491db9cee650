"""The call order per plan: one list of actions that the program, the model and the rig read."""

from __future__ import annotations

import pytest

from policies import Action, BoundaryPlan, Mode
from policies.call_order import boundary_actions, engine_calls_between

pytestmark = pytest.mark.spec

A = Action


def _plan(mode, stage=None, before=None):
  stage = mode.staged if stage is None else stage
  before = mode is Mode.STAGE_BEFORE_UPDATE if before is None else before
  return BoundaryPlan(step=0, mode=mode, stage=stage, stage_before_update=stage and before,
                      await_metrics=mode is Mode.OFF, reason="test")


EXPECTED = {
    Mode.OFF: (A.DISPATCH_LAST, A.UPDATE, A.METRICS, A.CHECKPOINT_AND_SYNC, A.DISPATCH_FIRST),
    Mode.PIPELINED: (A.DISPATCH_LAST, A.UPDATE, A.DISPATCH_FIRST, A.METRICS, A.CHECKPOINT_AND_SYNC),
    Mode.STAGE_AFTER_UPDATE: (A.DISPATCH_LAST, A.UPDATE, A.STAGE_FIRST, A.DISPATCH_FIRST_STAGED, A.METRICS,
                              A.CHECKPOINT_AND_SYNC),
    Mode.STAGE_BEFORE_UPDATE: (A.DISPATCH_LAST_DEFERRED, A.STAGE_FIRST, A.DEFERRED_UPDATE,
                               A.DISPATCH_FIRST_STAGED, A.METRICS, A.CHECKPOINT_AND_SYNC),
}


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.name)
def test_each_mode_has_the_design_tables_order(mode):
  assert boundary_actions(_plan(mode)) == EXPECTED[mode]


def test_the_last_step_updates_then_does_its_boundary_work():
  assert boundary_actions(None) == (A.DISPATCH_LAST, A.UPDATE, A.METRICS, A.CHECKPOINT_AND_SYNC)


def test_an_excluded_boundary_in_a_staged_mode_runs_pipelined():
  assert boundary_actions(_plan(Mode.STAGE_BEFORE_UPDATE, stage=False)) == EXPECTED[Mode.PIPELINED]


def test_sync_before_next_step_moves_checkpoint_and_sync_in_front_of_the_dispatch():
  actions = boundary_actions(_plan(Mode.STAGE_BEFORE_UPDATE), sync_before_next_step=True)
  assert actions.index(A.CHECKPOINT_AND_SYNC) < actions.index(A.DISPATCH_FIRST_STAGED) < actions.index(A.METRICS)
  assert boundary_actions(_plan(Mode.OFF), sync_before_next_step=True) == EXPECTED[Mode.OFF]


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.name)
def test_every_boundary_updates_once_and_dispatches_the_next_first_once(mode):
  actions = boundary_actions(_plan(mode))
  assert sum(a in (A.UPDATE, A.DEFERRED_UPDATE) for a in actions) == 1
  assert sum(a.dispatches_first for a in actions) == 1


def test_engine_calls_between_two_steps():
  calls = {mode: engine_calls_between(boundary_actions(_plan(mode))) for mode in Mode}
  assert calls == {Mode.OFF: ["update"], Mode.PIPELINED: ["update"],
                   Mode.STAGE_AFTER_UPDATE: ["update", "prepare"],
                   Mode.STAGE_BEFORE_UPDATE: ["prepare", "update"]}
  assert engine_calls_between(boundary_actions(None)) == ["update"]
