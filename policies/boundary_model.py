"""Boundary model: the timeline of one step boundary per mode, from component times.

Pure Python (no JAX), used by the rig to write predictions before its arms run
and by ``run_rl simulate`` as a planning tool. docs/rig.md gives each
component's unit, meaning, how a run identifies it and how it scales.

Model. One device runs its work in dispatch order; one host thread issues it.
Time 0 is the dispatch of step k's last micro-batch, which starts computing at
once (the device was busy with the micro-batch before it) — or, with
``host_runs_ahead`` (asynchronous dispatch with each input mapped while the
earlier micro-batches compute), after the step's earlier micro-batches, still
queued less the host's mapping and dispatch between them
(``queued_compute_s``). Host costs:
``dispatch_s`` per dispatch call, ``map_s`` to map one micro-batch's rollouts
into arrays and issue their copy, and the boundary work — ``metrics_s`` and
``logging_s`` (the METRICS action), ``checkpoint_s`` and ``weight_sync_s``
(CHECKPOINT_AND_SYNC). Device costs: ``micro_batch_s``, ``update_s``,
``copy_s`` (one micro-batch's inputs reaching the device) and, under dropless
re-runs, ``reruns_per_step`` re-runs of ``rerun_s`` each. ``update()`` returns
to the host once ``1 - update_overlap_share`` of the last micro-batch's compute
has passed (1: at once; 0: when it is done, as a read of its overflow flag
makes it), and dispatches that micro-batch's re-run (when it overflowed)
before the update. Inside a step each micro-batch after the first costs
``gap_for(mode)`` of device time outside any micro-batch (a round trip
per dispatch on a remote runtime, a flag read between micro-batches, a live
run's wait for the next micro-batch's sampling): the mode's own where
``gap_by_mode`` names one, else ``gap_per_dispatch_s``.

Per mode, the host's order is ``policies.call_order.boundary_actions`` — the
same list the program executes — and ``predict`` times it action by action.
The next step's rollouts keep the action that first needs them waiting —
STAGE_FIRST in the staged modes, DISPATCH_FIRST otherwise — and a
STAGE_BEFORE_UPDATE boundary that waits for them is timed in STAGE_AFTER_UPDATE's
order, as the policy plans it (``step_boundary.stage_order``) — for
``rollout_wait_for(mode)``: the mode's own wait where ``rollout_wait_by_mode``
names one (a fit names each mode it has an arm of), else ``rollout_wait_s``.
The wait is an input per mode, not derived from one time at which the
rollouts are ready: OFF asks for them after the boundary work, which overlaps
the sampler, the other modes before it; and where the sampler sets the pace the
trainer's whole cycle locks to it, so the rollouts' arrival relative to the
boundary moves with the mode as well (docs/rig.md).
``boundary_idle_s`` is the gap between update k finishing and step k+1's first
micro-batch starting; ``step_s`` adds it, any delay of the update's start and
the gaps inside the step to the compute-only bound ``M × micro_batch_s +
first_micro_batch_extra_s + update_s`` (plus re-runs).

A device wait that starts while compute still runs costs the larger of the
remaining compute and the wait floor (a remote runtime's round trip overlaps
the compute). A staged copy runs beside the compute; an unstaged ``fwd_bwd``
issues its copy at dispatch and, with ``sync_copy``, that copy queues behind
the update on the compute stream — there STAGE_AFTER_UPDATE hides more than
PIPELINED. With ``copy_s`` 0 or an asynchronous copy the two differ only by
where one dispatch call falls.

Known biases: boundary work never contends with compute (optimistic on a
2-core CPU, where host work and XLA share the memory bus), and a wait floor
is paid once per deferred update (pessimistic for runtimes whose floor
overlaps the wait). Without ``host_runs_ahead`` time 0 has only the last
micro-batch left to compute; where the previous boundary waited for rollouts, the step's micro-batches
were dispatched back to back and up to M - 1 more are still queued, so a
rollout wait that runs beside the compute (STAGE_BEFORE_UPDATE's) hides more
than the timeline lets it: the update delay is over-predicted by up to that
compute.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

from policies.call_order import Action, boundary_actions
from policies.step_boundary import BoundaryPlan, Mode, stage_order


@dataclasses.dataclass(frozen=True)
class Components:
  """Measured or assumed component times of one optimizer step (seconds unless named otherwise)."""

  micro_batch_s: float
  update_s: float
  # device: how much longer a step's first micro-batch computes than the others (the host's work after the
  # boundary — the record, dashboards, the policy — shares the cores with it on a CPU; about 0 on an accelerator);
  # negative where it computes faster (the later ones share the cores with the next input's mapping)
  first_micro_batch_extra_s: float = 0.0
  map_s: float = 0.0  # host: map one micro-batch's rollouts into arrays and issue their copy
  copy_s: float = 0.0  # device: one micro-batch's inputs reaching the device after the host issued them
  sync_copy: bool = False  # an unstaged fwd_bwd's copy queues on the compute stream, behind the update
  # the host dispatches a step's micro-batches without waiting for the device (asynchronous dispatch, each input
  # mapped while the earlier ones compute), so their compute is still queued when it dispatches the last one
  host_runs_ahead: bool = False
  metrics_s: float = 0.0  # host: read step k's metrics once the update is done
  logging_s: float = 0.0  # host: the step's record, dashboards and the policy's bookkeeping
  checkpoint_s: float = 0.0  # host: a checkpoint's save, per boundary (median over the steps)
  weight_sync_s: float = 0.0  # host: exporting the weights to the samplers
  update_overlap_share: float = 1.0  # of the last micro-batch's compute, the part update() leaves to the host
  dispatch_s: float = 0.0005  # host: one dispatch call
  gap_per_dispatch_s: float = 0.0  # device time lost before each micro-batch after a step's first
  wait_floor_s: float = 0.0  # the least a device wait costs (a remote runtime's round trip)
  rollout_wait_s: float = 0.0  # how long the next step's rollouts keep the stage or the first dispatch waiting
  # (mode value, seconds): a mode's own rollout wait, in place of rollout_wait_s — where a mode's call order asks
  # for the rollouts changes how long they keep it waiting (OFF asks after the boundary work, the others before)
  rollout_wait_by_mode: tuple[tuple[str, float], ...] = ()
  micro_batches_per_step: int = 1
  reruns_per_step: float = 0.0  # dropless re-runs per step (on average)
  rerun_s: float = 0.0
  # (mode value, seconds): a mode's own gap per dispatch, in place of gap_per_dispatch_s — in a live run the gap is
  # mostly the wait for the next micro-batch's sampling, which the sampler's pace beside each mode sets
  gap_by_mode: tuple[tuple[str, float], ...] = ()

  def gap_for(self, mode: Mode) -> float:
    """Device time lost before each micro-batch after a step's first, in ``mode``."""
    return dict(self.gap_by_mode).get(mode.value, self.gap_per_dispatch_s)

  def rollout_wait_for(self, mode: Mode) -> float:
    """How long the next step's rollouts keep ``mode``'s stage or first dispatch waiting."""
    return dict(self.rollout_wait_by_mode).get(mode.value, self.rollout_wait_s)

  @property
  def boundary_work_s(self) -> float:
    """The host's boundary work: metrics, logging, checkpoint and weight sync."""
    return self.metrics_s + self.logging_s + self.checkpoint_s + self.weight_sync_s

  @property
  def compute_bound_s(self) -> float:
    return (self.micro_batches_per_step * self.micro_batch_s + self.first_micro_batch_extra_s
            + self.reruns_per_step * self.rerun_s + self.update_s)

  def in_step_gaps_s(self, mode: Mode) -> float:
    """Device time inside a step outside any computation: one gap per micro-batch after the first."""
    return max(self.micro_batches_per_step - 1, 0) * self.gap_for(mode)

  @property
  def queued_compute_s(self) -> float:
    """Device compute still queued when the host dispatches a step's last micro-batch: that micro-batch's, and
    where the host runs ahead the earlier ones' too, less the host's mapping and dispatch between them."""
    if not self.host_runs_ahead:
      return self.micro_batch_s
    m = self.micro_batches_per_step
    ahead = m * self.micro_batch_s + self.first_micro_batch_extra_s - (m - 1) * (self.map_s + self.dispatch_s)
    return max(self.micro_batch_s, ahead)

  @property
  def last_rerun_s(self) -> float:
    """Expected re-run of the last micro-batch, which ``update()`` dispatches before the update."""
    share = min(1.0, self.reruns_per_step / max(self.micro_batches_per_step, 1))
    return share * self.rerun_s


@dataclasses.dataclass(frozen=True)
class Segment:
  lane: str  # "device" or "host"
  name: str  # micro-batch, update, stage, boundary work, idle, wait, dispatch
  start_s: float
  end_s: float


@dataclasses.dataclass(frozen=True)
class Prediction:
  mode: Mode
  boundary_idle_s: float
  boundary_idle_strict_s: float
  step_s: float
  update_delay_s: float
  segments: tuple[Segment, ...]

  def as_dict(self) -> dict:
    return {
        "mode": self.mode.value,
        "boundary_idle_s": self.boundary_idle_s,
        "boundary_idle_strict_s": self.boundary_idle_strict_s,
        "step_s": self.step_s,
        "update_delay_s": self.update_delay_s,
    }


@dataclasses.dataclass
class _Timeline:
  """Host and device clocks while the model walks one boundary's actions."""

  c: Components
  host: float
  segments: list
  update_dispatch: float | None = None
  update_done: float | None = None
  first_dispatch: float | None = None
  first_inputs_ready: float = 0.0  # when the first micro-batch's inputs are on the device

  @property
  def last_done(self) -> float:
    return self.c.queued_compute_s

  def host_segment(self, name: str, seconds: float) -> None:
    self.segments.append(Segment("host", name, self.host, self.host + seconds))
    self.host += seconds

  def dispatch_update(self, update_dispatch: float) -> None:
    c = self.c
    self.update_dispatch = update_dispatch
    update_start = max(update_dispatch, self.last_done)
    if c.last_rerun_s:
      self.segments.append(Segment("device", "re-run", update_start, update_start + c.last_rerun_s))
    self.update_done = update_start + c.last_rerun_s + c.update_s
    self.segments.append(Segment("device", "update", self.update_done - c.update_s, self.update_done))
    self.host = update_dispatch


def _step(t: _Timeline, action: Action, mode: Mode) -> None:
  """Advances the timeline by one action (actions after the first dispatch hide behind compute)."""
  c, d = t.c, t.c.dispatch_s
  rollout_wait = c.rollout_wait_for(mode)  # spent where the action that needs the rollouts falls
  if action is Action.STAGE_FIRST:
    if rollout_wait:
      t.host_segment("rollout wait", rollout_wait)
    t.host_segment("stage", c.map_s)
    t.first_inputs_ready = t.host + c.copy_s  # a staged copy runs beside the compute
  elif action is Action.DEFERRED_UPDATE:
    # The update goes first (handing the host back as UPDATE does); then, where the last micro-batch still
    # computes, the host waits for it: the larger of its remaining compute and the floor.
    released = (1.0 - c.update_overlap_share) * t.last_done
    t.dispatch_update(max(t.host, released) + d)
    if t.host < t.last_done:
      wait_end = max(t.last_done, t.host + c.wait_floor_s)
      t.segments.append(Segment("host", "wait", t.host, wait_end))
      t.host = wait_end
  elif action is Action.UPDATE:
    # update() hands the host back once (1 - overlap share) of the last micro-batch has run.
    released = (1.0 - c.update_overlap_share) * t.last_done
    t.dispatch_update(max(t.host, released) + d)
  elif action is Action.METRICS:
    t.host = max(t.host, t.update_done)  # the metrics read waits for the update
    t.host_segment("boundary work", c.metrics_s + c.logging_s)
  elif action is Action.CHECKPOINT_AND_SYNC:
    t.host = max(t.host, t.update_done)  # saving and exporting read the updated state
    t.host_segment("boundary work", c.checkpoint_s + c.weight_sync_s)
  elif action is Action.DISPATCH_FIRST:  # maps and places inside the call
    if rollout_wait:
      t.host_segment("rollout wait", rollout_wait)
    t.host_segment("stage" if mode is Mode.STAGE_AFTER_UPDATE else "prepare", c.map_s)
    t.first_dispatch = t.host + d
    # A synchronous copy queues behind the update on the compute stream; an asynchronous one runs beside it.
    t.first_inputs_ready = (max(t.update_done, t.first_dispatch) if c.sync_copy else t.first_dispatch) + c.copy_s
  elif action is Action.DISPATCH_FIRST_STAGED:
    t.first_dispatch = t.host + d


def predict(c: Components, mode: Mode, *, sync_before_next_step: bool = False) -> Prediction:
  """The timeline of one boundary in ``mode`` and what it implies for idle and step time.

  Time 0 is the dispatch of step k's last micro-batch; the host has just issued it, and the device has
  ``queued_compute_s`` left to compute.
  """
  t = _Timeline(c, c.dispatch_s, [Segment("device", "last micro-batch" if c.queued_compute_s == c.micro_batch_s
                                           else "queued micro-batches", 0.0, c.queued_compute_s)])
  # A wait for rollouts means the next micro-batch is not sampled when the boundary is planned: the policy then
  # stages after the update (``stage_order``), and so does the model.
  plan = BoundaryPlan.for_mode(0, mode, staged_as=stage_order(mode, c.rollout_wait_for(mode) == 0), reason="modelled")
  for action in boundary_actions(plan, sync_before_next_step=sync_before_next_step):
    if t.first_dispatch is not None:
      break
    _step(t, action, mode)
  first_start = max(t.update_done, t.first_dispatch, t.first_inputs_ready)
  idle = max(0.0, first_start - t.update_done)
  if idle > 0:
    t.segments.append(Segment("device", "idle", t.update_done, first_start))
  t.segments.append(Segment("device", "first micro-batch", first_start, first_start + c.micro_batch_s))
  update_delay = max(0.0, t.update_dispatch - t.last_done)
  # Re-runs of earlier micro-batches sit inside the step; the last one's is already in update_done.
  return Prediction(mode=mode, boundary_idle_s=idle, boundary_idle_strict_s=idle + update_delay,
                    step_s=c.compute_bound_s + c.in_step_gaps_s(mode) + idle + update_delay,
                    update_delay_s=update_delay, segments=tuple(t.segments))


def band(prediction_s: float, *, rel: float, abs_s: float) -> tuple[float, float]:
  """An allowed band around a prediction: ± max(rel × value, abs_s), floored at 0."""
  tol = max(rel * prediction_s, abs_s)
  return max(0.0, prediction_s - tol), prediction_s + tol


# ---------------------------------------------------------------------------------------------- scaling

@dataclasses.dataclass(frozen=True)
class JobShape:
  """What the scaling rules read of a job: its batch, mesh and model."""

  rows: int  # per micro-batch
  tokens_per_row: int
  micro_batches_per_step: int
  devices: int
  hosts: int
  model: str
  context: int = 1  # of the devices, how many split each row's tokens (the rest split the rows)
  bytes_per_token: float = 32.0  # the staged input's bytes per token, every field (routing included)
  #: Hosts that map and copy the inputs: every host where each feeds its own devices, one under a
  #: single-controller runtime that sends every device its inputs (None: ``hosts``).
  feeding_hosts: int | None = None

  @property
  def rows_per_device(self) -> float:
    return self.rows / (self.devices // self.context)

  @property
  def tokens_per_row_per_device(self) -> float:
    return self.tokens_per_row / self.context

  @property
  def tokens_per_device(self) -> float:
    return self.rows * self.tokens_per_row / self.devices

  @property
  def input_bytes(self) -> float:
    """One micro-batch's staged input: rows × tokens per row × bytes per token."""
    return self.rows * self.tokens_per_row * self.bytes_per_token

  @property
  def input_bytes_per_device(self) -> float:
    return self.input_bytes / self.devices

  @property
  def input_hosts(self) -> int:
    return self.feeding_hosts or self.hosts

  @property
  def input_bytes_per_feeding_host(self) -> float:
    """What each host that feeds the inputs maps and sends through its link, per micro-batch."""
    return self.input_bytes / self.input_hosts

  def quantity(self, name: str) -> float:
    """The quantity a scaling rule is proportional to (``SCALING``'s first column)."""
    return {"tokens_per_device": self.tokens_per_device,
            "input_bytes_per_feeding_host": self.input_bytes_per_feeding_host,
            "weights_per_device": 1.0 / self.devices, "weights_per_host": 1.0 / self.hosts,
            "micro_batches": float(self.micro_batches_per_step)}[name]


#: One row per component: what it is proportional to (None: it stays as it is) and the rule in words.
#: ``weights_*`` rules hold for the same model only: across models those components are not scaled.
SCALING: dict[str, tuple[str | None, str]] = {
    "micro_batch_s": ("tokens_per_device", "compute grows with the tokens each device holds"
                                           " (rows x tokens per row / devices)"),
    "rerun_s": ("tokens_per_device", "a re-run is a micro-batch's compute again"),
    "update_s": ("weights_per_device", "the optimizer touches each device's shard of the weights (1 / devices)"),
    "map_s": ("input_bytes_per_feeding_host", "each feeding host maps its share of a micro-batch's bytes"
                                              " (rows x tokens per row x bytes per token / feeding hosts)"),
    "copy_s": ("input_bytes_per_feeding_host", "each feeding host's link carries its share of the inputs' bytes"
                                               " (rows x tokens per row x bytes per token / feeding hosts)"),
    "checkpoint_s": ("weights_per_host", "each host saves its shard of the state (1 / hosts)"),
    "weight_sync_s": ("weights_per_host", "each host exports its shard of the weights (1 / hosts)"),
    "reruns_per_step": ("micro_batches", "re-runs are a share of the micro-batches"),
    "first_micro_batch_extra_s": (None, "the host's work beside the first micro-batch, per step"),
    "metrics_s": (None, "a few scalars per step"),
    "logging_s": (None, "one record per step"),
    "dispatch_s": (None, "one host call"),
    "gap_per_dispatch_s": (None, "one round trip per dispatch"),
    "gap_by_mode": (None, "one round trip per dispatch, or the sampler's pace beside each mode"),
    "wait_floor_s": (None, "the runtime's round trip"),
    "rollout_wait_s": (None, "set by the samplers, not by the trainer's shape"),
    "rollout_wait_by_mode": (None, "set by the samplers and where each mode asks for the rollouts"),
    "update_overlap_share": (None, "a share of the last micro-batch (whether update() reads its flag)"),
    "sync_copy": (None, "how the runtime queues a copy"),
    "host_runs_ahead": (None, "how the runtime queues dispatches"),
}
_MODEL_BOUND = ("tokens_per_device", "weights_per_device", "weights_per_host")  # depend on the model


@dataclasses.dataclass(frozen=True)
class ScaledChange:
  """One component taken from one job to another, and the rule it rests on."""

  component: str
  factor: float
  rule: str

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def scale_values(values: Mapping, source: JobShape, target: JobShape) -> tuple[dict, list[ScaledChange]]:
  """``values`` (component name → value) taken from ``source``'s shape to ``target``'s by ``SCALING``."""
  out, changes = dict(values), []
  for name, value in values.items():
    quantity, rule = SCALING.get(name, (None, "not a scaled component"))
    if quantity is None or isinstance(value, bool) or not value:  # a zero stays zero: no rule to cite
      continue
    if quantity in _MODEL_BOUND and source.model != target.model:
      changes.append(ScaledChange(name, 1.0, f"not scaled: {target.model} is another model than"
                                             f" {source.model} (set it in simulate, or fit a run of it)"))
      continue
    factor = target.quantity(quantity) / source.quantity(quantity)
    if factor != 1.0:
      out[name] = value * factor
      changes.append(ScaledChange(name, factor, f"{rule}: x{factor:.3g}"))
  return out, changes


def scale(c: Components, source: JobShape, target: JobShape) -> tuple[Components, list[ScaledChange]]:
  """``c`` fitted or measured on ``source``, taken to ``target`` (micro-batches per step included)."""
  values, changes = scale_values({f.name: getattr(c, f.name) for f in dataclasses.fields(c)
                                  if f.name != "micro_batches_per_step"}, source, target)
  return consistent(dataclasses.replace(c, **values, micro_batches_per_step=target.micro_batches_per_step)), changes


def consistent(c: Components) -> Components:
  """``c`` with a first micro-batch that takes no less than nothing, and no extra at all at one micro-batch per
  step (where it is inside ``micro_batch_s``): a faster first micro-batch fitted on one job, taken to another
  whose micro-batch is shorter, would otherwise make a step shorter than its compute."""
  extra = 0.0 if c.micro_batches_per_step <= 1 else max(c.first_micro_batch_extra_s, -c.micro_batch_s)
  return c if extra == c.first_micro_batch_extra_s else dataclasses.replace(c, first_micro_batch_extra_s=extra)


# ---------------------------------------------------------------------------------------------- estimates

@dataclasses.dataclass(frozen=True)
class Unknown:
  """What a run cannot identify: the values it may take, each a set of component overrides."""

  name: str
  why: str
  options: tuple[Mapping, ...]

  def as_dict(self) -> dict:
    return {"name": self.name, "why": self.why, "options": [dict(o) for o in self.options]}


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Components with where each came from (recipe, fitted, calibrated, default, ...) and what is unknown.

  ``components`` is the point the prediction is quoted at; each ``Unknown``'s
  options are the other values the run allows, and a bounded prediction spans
  every combination of them.
  """

  components: Components
  sources: Mapping[str, str]
  unknowns: tuple[Unknown, ...] = ()

  def scaled(self, source: JobShape, target: JobShape) -> tuple["Estimate", list[ScaledChange]]:
    components, changes = scale(self.components, source, target)
    unknowns = tuple(dataclasses.replace(u, options=tuple(scale_values(o, source, target)[0] for o in u.options))
                     for u in self.unknowns)
    return Estimate(components, self.sources, unknowns), changes

  def variants(self) -> list[Components]:
    """The point and every combination the unknowns allow."""
    out = [self.components]
    for combo in itertools.product(*(u.options for u in self.unknowns)):
      merged = {k: v for option in combo for k, v in option.items()}
      out.append(dataclasses.replace(self.components, **merged))
    return out


@dataclasses.dataclass(frozen=True)
class BoundedPrediction:
  """A prediction at the estimate's point, and the range its unknowns allow."""

  point: Prediction
  step_range_s: tuple[float, float]
  idle_range_s: tuple[float, float]

  def as_dict(self) -> dict:
    return {**self.point.as_dict(), "step_range_s": list(self.step_range_s),
            "boundary_idle_range_s": list(self.idle_range_s)}


def predict_bounded(estimate: Estimate, mode: Mode, *, sync_before_next_step: bool = False) -> BoundedPrediction:
  """``predict`` at the estimate's point and over every combination its unknowns allow."""
  all_ = [predict(c, mode, sync_before_next_step=sync_before_next_step) for c in estimate.variants()]
  steps, idles = [p.step_s for p in all_], [p.boundary_idle_s for p in all_]
  return BoundedPrediction(all_[0], (min(steps), max(steps)), (min(idles), max(idles)))
