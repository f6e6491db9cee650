"""The rig's view into an arm: an engine proxy that logs every call the program's worker makes."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from orchestrator import contract
from orchestrator.rig.arms import RigError

#: The Protocols whose methods the proxy forwards; it has each method exactly when the engine does.
FORWARDED_PROTOCOLS = (contract.TrainingEngine, contract.StagingEngine, contract.CheckpointingEngine,
                       contract.WeightSource, contract.SnapshotEngine, contract.MemoryReportingEngine)


def require_snapshots(engine: Any) -> None:
  """Refuses an engine the rig cannot return to one starting state before every arm (``SnapshotEngine``)."""
  missing = contract.missing_methods(engine, contract.SnapshotEngine)
  if missing:
    raise RigError(f"the rig restores the engine to one snapshot before every arm; {type(engine).__name__}"
                   f" lacks {', '.join(missing)}")


class CallRecordingEngine:
  """Passes every call to the engine and logs (kind, content digest) — for the rig's checks.

  The proxy satisfies the same ``orchestrator.contract`` Protocols as the
  engine it wraps, on every Python: it defines each Protocol method itself
  (from Python 3.12, ``isinstance`` against a runtime Protocol looks methods
  up statically and never reaches ``__getattr__``). Each method the engine
  lacks (or has set to None) is None on the proxy's class too: constructing
  one gives an instance of a subclass per set of missing methods, because a
  Protocol of methods only is first checked against the class. So
  ``isinstance`` and ``contract.missing_methods`` see what the engine can do,
  no more. Other attributes (``rows``, ``rerun_dropped``, ...) are forwarded
  by ``__getattr__``.

  ``fault`` injects a bug for negative controls: ``skip_update`` drops the
  update of step 1.
  """

  def __new__(cls, engine, *args, **kwargs):
    del args, kwargs  # for __init__
    missing = frozenset(name for protocol in FORWARDED_PROTOCOLS for name in contract.missing_methods(engine, protocol))
    return super().__new__(_without(cls, missing))

  def __init__(self, engine, digests: dict[int, str], fault: str | None = None, digest_of=None):
    self._engine = engine
    self._digests = digests
    self._digest_of = digest_of  # payload -> content digest, for payloads ``digests`` does not know
    self._fault = fault
    self.events: list[tuple[str, Any]] = []  # (kind, payload or prepared input); see digest_events
    self._updates_seen = 0

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def digest_events(self) -> list[tuple[str, str | None]]:
    """The call log with content digests (prepared inputs are hashed here, after the arm)."""
    def digest(x):
      known = getattr(x, "digest", None) or self._digests.get(id(x))
      return known if known or x is None or self._digest_of is None else self._digest_of(x)

    return [(kind, digest(x)) for kind, x in self.events]

  # ------------------------------------------------------------------ recorded calls
  def fwd_bwd(self, x, apply_optimizer=False):
    self.events.append(("fwd_bwd", x))
    result = self._engine.fwd_bwd(x)
    if apply_optimizer:
      self.update()
    return result

  def update(self):
    self._updates_seen += 1
    if self._fault == "skip_update" and self._updates_seen == 2:
      return None  # the injected bug: no update at all
    self.events.append(("update", None))
    return self._engine.update()

  def prepare_fwd_bwd_input(self, payload):
    prepared = self._engine.prepare_fwd_bwd_input(payload)
    self.events.append(("prepare", prepared))
    return prepared

  def wait_for_device(self):
    self.events.append(("wait", None))
    return self._engine.wait_for_device()

  # ------------------------------------------------------------------ forwarded as they are
  def get_metrics(self) -> Mapping[str, Any]:
    return self._engine.get_metrics()

  def save_checkpoint(self, metadata: Mapping[str, Any] | None = None) -> str:
    return self._engine.save_checkpoint(metadata)

  def restore_checkpoint(self, step: int | None = None) -> Mapping[str, Any]:
    return self._engine.restore_checkpoint(step)

  def export_weights(self) -> Any:
    return self._engine.export_weights()

  def state_digest(self) -> str:
    return self._engine.state_digest()

  def device_memory(self) -> contract.DeviceMemory | None:
    return self._engine.device_memory()

  def snapshot(self) -> Any:
    return self._engine.snapshot()

  def restore(self, snapshot: Any) -> None:
    return self._engine.restore(snapshot)


@functools.cache
def _without(cls: type, missing: frozenset[str]) -> type:
  """``cls``, or its subclass with the ``missing`` methods set to None (what Protocols read as absent)."""
  if not missing:
    return cls
  return type(cls.__name__, (cls,), {"__doc__": cls.__doc__, **dict.fromkeys(sorted(missing))})
