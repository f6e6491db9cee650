"""The rig's view into an arm: an engine proxy that logs every call the program's worker makes."""

from __future__ import annotations

from typing import Any


class CallRecordingEngine:
  """Passes every call to the engine and logs (kind, content digest) — for the rig's checks.

  ``fault`` injects a bug for negative controls: ``skip_update`` drops the
  update of step 1.
  """

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
