"""Fakes for the tests: a recording engine (every call the worker and program make, in order), one whose stage is
slower than its compute, a live source whose rollouts stop arriving, an in-memory key-value client."""

from __future__ import annotations

import dataclasses
import threading
import time

from orchestrator.contract import HeldOutScore, Receipt


@dataclasses.dataclass(frozen=True)
class Prepared:
  name: str
  digest: str


class RecordingEngine:
  """Engine with the full contract (staging included) that logs each call as a string."""

  def __init__(self, wait_s: float = 0.5):
    self.calls: list[str] = []
    self.step = 0
    self.micro = 0
    self.wait_s = wait_s
    self.params = {"step": 0}
    self.checkpoints: list[dict] = []  # each save's metadata

  def fwd_bwd(self, x, apply_optimizer=False):
    name = f"prepared:{x.name}" if isinstance(x, Prepared) else x
    self.calls.append(f"fwd_bwd:{name}")
    self.micro += 1
    if apply_optimizer:
      self.update()

  def update(self):
    self.calls.append("update")
    self.step += 1
    self.micro = 0
    self.params = {"step": self.step}
    return self.step

  def get_metrics(self):
    self.calls.append(f"metrics:{self.step}")
    return {"step": self.step, "loss": 0.0}

  def save_checkpoint(self, metadata=None):
    self.calls.append(f"checkpoint:{self.step}")
    self.checkpoints.append(dict(metadata or {}))
    return f"ckpt/{self.step}"

  def restore_checkpoint(self, step=None):
    return {"step": self.step}

  def export_weights(self):
    return self.params

  def prepare_fwd_bwd_input(self, payload):
    self.calls.append(f"prepare:{payload}")
    return Prepared(payload, digest=f"digest-{payload}")

  def wait_for_device(self):
    self.calls.append("wait")
    return self.wait_s

  def state_digest(self):
    return f"state-{self.step}"


class _Handle:
  """A completion handle whose computation ends ``compute_s`` after its dispatch; a wait on the main thread logs
  ``ready:<name>`` (the completion watcher's, on its own thread, does not)."""

  def __init__(self, name: str, calls: list[str], compute_s: float):
    self.name, self.calls, self.done_at = name, calls, time.perf_counter() + compute_s

  def block_until_ready(self):
    if threading.current_thread() is threading.main_thread():
      self.calls.append(f"ready:{self.name}")
    time.sleep(max(0.0, self.done_at - time.perf_counter()))
    return self


class HandleEngine(RecordingEngine):
  """The recording engine whose micro-batches hand back completion handles, each computing ``compute_s``.

  ``update_blocks``: its ``update()`` waits for the last micro-batch first (a dropped-token flag read) and says
  how long in ``host_wait_s`` (``report_host_wait=False``: it does not say).
  """

  def __init__(self, compute_s: float = 0.0, *, update_blocks: bool = False, report_host_wait: bool = True):
    super().__init__()
    self.compute_s, self.update_blocks, self.report_host_wait = compute_s, update_blocks, report_host_wait
    self.last: _Handle | None = None

  def fwd_bwd(self, x, apply_optimizer=False):
    super().fwd_bwd(x)
    name = f"prepared:{x.name}" if isinstance(x, Prepared) else x
    self.last = _Handle(name, self.calls, self.compute_s)
    if apply_optimizer:
      self.update()
    return self.last

  def update(self):
    start = time.perf_counter()
    if self.update_blocks and self.last is not None:
      time.sleep(max(0.0, self.last.done_at - time.perf_counter()))
    waited = time.perf_counter() - start
    step = super().update()
    return Receipt(kind="update", step=step - 1, micro_step=-1, ready=None, dispatched_at=time.perf_counter(),
                   mapping_s=0.0, placement_s=0.0, host_wait_s=waited if self.report_host_wait else None)


class SlowStagingEngine(RecordingEngine):
  """The recording engine whose stage takes ``stage_s`` (a sleep), longer than its last micro-batch (which
  computes nothing), while its device wait reads ``wait_s``: a staged boundary is slower than an unstaged one,
  yet the wait proxy, at a threshold below ``wait_s``, never calls the wait low."""

  def __init__(self, stage_s: float, wait_s: float = 0.5):
    super().__init__(wait_s)
    self.stage_s = stage_s

  def prepare_fwd_bwd_input(self, payload):
    time.sleep(self.stage_s)
    return super().prepare_fwd_bwd_input(payload)


class NoStagingEngine(RecordingEngine):
  """The same engine without the optional staging methods (what a stock trainer looks like)."""

  prepare_fwd_bwd_input = None
  wait_for_device = None


class DivergingEngine(RecordingEngine):
  """The recording engine whose loss and gradient norm are NaN from program step ``from_step`` on.

  With ``skipped`` it says it skipped those updates (what ``skip_nonfinite_updates`` reports).
  """

  def __init__(self, from_step: int, *, skipped: bool = False, wait_s: float = 0.5):
    super().__init__(wait_s)
    self.from_step, self.skipped = from_step, skipped

  def get_metrics(self):
    metrics = dict(super().get_metrics(), grad_norm=1.0)
    if self.step > self.from_step:  # step k's metrics are read after its update: self.step is k + 1
      metrics.update(loss=float("nan"), grad_norm=float("nan"), skipped_update=self.skipped)
    return metrics


def payload_steps(steps: int, micro: int):
  return [[f"s{k}m{i}" for i in range(micro)] for k in range(steps)]


class FakeKeyValueClient:
  """The coordinator's key-value store, in memory; a missing key times out at once."""

  def __init__(self, store=None):
    self.store = {} if store is None else store
    self.deleted = []

  def key_value_set(self, key, value, allow_overwrite=False):
    assert allow_overwrite or key not in self.store, key
    self.store[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.store:
      raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_ms} ms")
    return self.store[key]

  def key_value_delete(self, key):  # a key and everything under it, as the coordinator does
    self.deleted.append(key)
    for k in [k for k in self.store if k == key or k.startswith(key + "/")]:
      del self.store[k]

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in list(self.store.items()) if k.startswith(prefix)]  # a copy: watchdogs' threads


class StuckLiveSource:
  """A live step source (``StepSource`` and ``LiveSource``) whose rollouts stop arriving at step ``stuck_at``.

  Steps are ``payload_steps``' names. Step ``s`` is sampled with weights ``s - staleness``, so at staleness >= 1
  a checkpoint before step ``s`` must carry it, like ``LiveRollouts``'s: a checkpoint at ``stuck_at`` or later
  can never be written. ``waited`` counts the timed waits on a step that never arrives. With ``stuck_micro``,
  step ``stuck_at``'s first micro-batches arrive and the loop takes it, but micro-batch ``stuck_micro`` never
  does (a sampler stuck in the middle of a streamed step).
  """

  kind = "stuck-live"

  def __init__(self, steps: int, micro: int, *, stuck_at: int, staleness: int = 1, stuck_micro: int | None = None):
    self._steps = payload_steps(steps, micro)
    self.stuck_at, self.staleness, self.stuck_micro = stuck_at, staleness, stuck_micro
    self.next_step = 0
    self.waited = 0
    self.left_s: float | None = None  # what sampling_left_s says while the rollouts have not come
    self.synced: list[int] = []

  # StepSource
  def __iter__(self):
    return self

  def __next__(self):
    if self.next_step >= self.stuck_at + (self.stuck_micro is not None):
      raise AssertionError(f"step {self.next_step} was taken before ready() said it was there")
    self.next_step += 1
    return self._steps[self.next_step - 1]

  def get_state(self):
    return {"kind": self.kind, "next_step": self.next_step}

  def state_json(self, state):
    return dict(state)

  def set_state(self, state):
    self.next_step = state["next_step"]

  def count_steps(self, limit):
    return min(limit, len(self._steps))

  def close(self):
    pass

  # LiveSource
  last_wait_s = 0.0

  def blocked_on_sync(self, step):
    return self.staleness == 0 and step > 0

  def sync(self, version, weights):
    self.synced.append(version)

  def step_stats(self, step):
    return None

  def check(self):
    pass

  def sampling_on_trainer_devices_s(self, start, end):
    return None

  def evaluate(self, weights, version, prompts, *, pass_k=0, stop=None):
    return HeldOutScore(accuracy=0.0)

  def keep_start_weights(self, weights):
    pass

  def eval_prompt_count(self, asked):
    return asked

  def held_out_count(self, limit):
    return limit

  def recorded_steps(self):
    return None

  def release(self):
    pass

  def step_samples(self, step, count):
    return []

  def ready(self, step, timeout_s):
    return self._arrives(lambda: step < self.stuck_at or (step == self.stuck_at and self.stuck_micro is not None),
                         timeout_s)

  def micro_batch_ready(self, step, index, timeout_s):
    return self._arrives(lambda: step != self.stuck_at or index < self.stuck_micro, timeout_s)

  def ready_to_checkpoint(self, position, timeout_s, *, extendable=True):
    return self._arrives(lambda: self.staleness == 0 or position < self.stuck_at, timeout_s)

  def sampling_left_s(self, position):
    return 0.0 if self.staleness == 0 or position < self.stuck_at else self.left_s

  def _arrives(self, there, timeout_s: float) -> bool:
    """Whether ``there()`` turns true within ``timeout_s`` (a test may let stuck rollouts come: ``stuck_at``)."""
    if there():
      return True
    self.waited += 1
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the whole timeout, as a source whose sampler is stuck
      time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
      if there():
        return True
    return False


def run_in_thread(program):
  """Runs ``program`` on a daemon thread; returns (the thread, a dict that gets "result" or "error")."""
  outcome = {}

  def run():
    try:
      outcome["result"] = program.run()
    except Exception as e:  # pylint: disable=broad-except  # the test reads it
      outcome["error"] = e

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread, outcome
