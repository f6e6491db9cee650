"""Admitting the processes of a job: every process runs the same settings and the same version.

Processes that were started with different recipes join one job without
complaint and then go wrong later in ways that name nothing: a wrong digest
(another learning rate, another seed), a deadlock (another number of
micro-batches), a lost process (another number of steps). So the first
exchange of a job, right after joining and before any device work, compares
them: each process posts its settings (a flat key → value mapping; the caller
leaves out what may differ per process) under its own key, then exchanges
their digest and its version. Every process finds the same first process
whose digest or version differs from process 0's, reads both mappings, and
raises the same ``JobMismatchError``: every process stops, none waits for the
others.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Mapping
from typing import Any

from orchestrator.distributed.agreement import SingleProcess

_KEY = "step_boundary/admission/"
TAG = "admission"
_MISSING = object()
PACKAGE = "step-boundary"


class JobMismatchError(RuntimeError):
  """The processes of a job run different settings or versions (the message names the first difference)."""


def project_version() -> str:
  """The installed version of this project (``unknown`` when it runs from a source tree that is not installed)."""
  try:
    return importlib.metadata.version(PACKAGE)
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def settings_digest(settings: Mapping[str, Any]) -> str:
  """A digest of ``settings`` (JSON values) that does not depend on the keys' order."""
  text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def first_difference(reference: Mapping[str, Any], other: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
  """The first key whose values differ — in ``reference``'s order, then keys only ``other`` has — with both
  values (a key one side lacks reads as ``_MISSING``); None when both hold the same."""
  for key in [*reference, *(k for k in other if k not in reference)]:
    mine, theirs = reference.get(key, _MISSING), other.get(key, _MISSING)
    if mine != theirs or type(mine) is not type(theirs):  # 1 == 1.0 == True, yet they configure differently
      return key, mine, theirs
  return None


def _shown(value: Any) -> str:
  return "(not a key there)" if value is _MISSING else json.dumps(value)


def mismatch_line(process_id: int, reference: Mapping[str, Any], other: Mapping[str, Any]) -> str | None:
  """What every process says when process ``process_id``'s settings differ from process 0's; None if alike."""
  found = first_difference(reference, other)
  if found is None:
    return None
  key, mine, theirs = found
  return (f"process {process_id}'s recipe differs from process 0's at {key}: {_shown(mine)} (process 0) vs"
          f" {_shown(theirs)} (process {process_id}); start every process with the same recipe")


def admit(agreement: SingleProcess, client, settings: Mapping[str, Any], *, version: str | None = None) -> None:
  """Compares this job's processes (see the module docstring); returns when every one matches process 0.

  Args:
    agreement: the job's agreement; admission must be its first exchange.
    client: the coordinator's key-value client (each process's settings are posted there).
    settings: this process's settings that must agree (JSON values).
    version: this process's version (default: ``project_version()``).

  Raises:
    JobMismatchError: in every process alike, naming the first process that differs and how.
    ProcessLostError / AgreementError: a process did not reach admission in time, or is at another exchange.
  """
  if agreement.num_processes == 1:
    return
  version = project_version() if version is None else version
  settings = json.loads(json.dumps(dict(settings)))  # as every peer reads it back (a tuple is a list there)
  client.key_value_set(_KEY + str(agreement.process_id), json.dumps(settings))
  posted = agreement.exchange(TAG, {"version": version, "digest": settings_digest(settings)})
  reference = posted[0]
  for peer, theirs in enumerate(posted):
    if theirs == reference:
      continue
    if theirs["version"] != reference["version"]:
      raise JobMismatchError(
          f"process {peer} runs {PACKAGE} {theirs['version']} but process 0 runs {reference['version']};"
          " install the same version on every host")
    line = mismatch_line(peer, _posted_settings(agreement, client, 0, settings),
                         _posted_settings(agreement, client, peer, settings))
    raise JobMismatchError(line or f"process {peer}'s settings differ from process 0's in their digest only;"
                           " start every process with the same recipe")


def _posted_settings(agreement: SingleProcess, client, process_id: int, mine: dict) -> dict:
  """Process ``process_id``'s posted settings (it posted them before the exchange that named it)."""
  if process_id == agreement.process_id:
    return mine
  text = client.blocking_key_value_get(_KEY + str(process_id), int(agreement.timeout_s * 1000))
  return json.loads(text)
