"""Checkpoints of an engine's training state (orbax), written synchronously.

The state is saved as a flat mapping (``00012['params']['layers']...`` → array)
so that restoring needs no pytree registration, and restored onto the shardings
of a template state of the same structure.
"""

from __future__ import annotations

import logging
import numbers
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax._src import distributed

from orchestrator.contract import NoCheckpointError
from orchestrator.user_files import MIB, check_regular

# A checkpoint's JSON metadata grows with the model's leaves (orbax's) and the run's state (ours), far below this.
METADATA_MAX_BYTES = 256 * MIB


def flatten_state(tree: Any) -> dict[str, Any]:
  """Leaves of ``tree`` keyed by position and path (keys sort in leaf order)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {f"{i:05d}{jax.tree_util.keystr(p)}": x for i, (p, x) in enumerate(leaves)}


class Checkpointer:
  """Saves and restores one engine's state under ``directory`` (orbax ``CheckpointManager``)."""

  def __init__(self, directory: str | Path, *, max_to_keep: int = 3):
    self._ocp = ocp
    self.directory = Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    )

  def step_path(self, step: Any) -> Path:
    """Where checkpoint ``step`` lives, with every link followed; it must lie inside ``directory``.

    A step is a non-negative integer (not a bool); it names a directory of its
    own under ``directory``, and a link there that leads elsewhere (another
    run's checkpoint) is refused rather than read or written through.

    Raises:
      ValueError: ``step`` is not a non-negative integer, or its path resolves outside ``directory``.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
      raise ValueError(f"checkpoint step {step!r} is not a non-negative integer; give the step of a checkpoint"
                       f" in {self.directory}")
    root = self.directory.resolve()
    path = (root / str(int(step))).resolve()
    if path == root or not path.is_relative_to(root):
      raise ValueError(f"checkpoint {int(step)} in {root} leads to {path}, outside that directory; remove the link"
                       " (copy the checkpoint in to use it)")
    return path

  def save(self, step: int, state: Any, metadata: Mapping[str, Any]) -> str:
    """Writes ``state`` and ``metadata`` as checkpoint ``step``; returns its path once complete.

    Synchronous: the engine donates its optimizer state to the next update.

    Raises:
      ValueError: ``step`` is not a non-negative integer, or a link there leads outside ``directory``.
      RuntimeError: the checkpoint library skipped the save (a checkpoint of
        ``step`` already exists there).
    """
    self.step_path(step)
    ocp = self._ocp
    saved = self._manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(flatten_state(state)),
            # The checkpoint's own step last: a caller's metadata cannot overwrite what restore trusts.
            metadata=ocp.args.JsonSave({**dict(metadata), "step": step}),
        ),
    )
    self._manager.wait_until_finished()
    if not saved:
      raise RuntimeError(
          f"checkpoint {step} was not written: {self.directory} already holds a checkpoint of"
          " that step (another run's?); use a new checkpoint directory"
      )
    return str(self.directory / str(step))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore(self, template: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Loads checkpoint ``step`` (default: the latest) onto ``template``'s shardings.

    Returns the state (same structure as ``template``) and the metadata.

    Raises:
      ValueError: ``step`` is not a non-negative integer, or its checkpoint lies outside ``directory``
        (``step_path``); checked before anything is read.
      NoCheckpointError: there is no checkpoint (of ``step``).
    """
    ocp = self._ocp
    # The directory as it is now, not as this manager last listed it: a resume moves the checkpoints after the
    # one it continues from aside (app.resume), and this engine then writes those steps anew.
    self._manager.reload()
    step = self.latest_step() if step is None else step
    if step is None:
      raise NoCheckpointError(f"no checkpoint in {self.directory} (it holds none); a trainer restores only"
                              " checkpoints it wrote there: start it with the checkpoint directory of the run")
    path = self.step_path(step)
    if not path.is_dir():
      held = sorted(self._manager.all_steps())
      raise NoCheckpointError(f"no checkpoint of step {step} in {self.directory}"
                       f" ({'it holds steps ' + ', '.join(map(str, held)) if held else 'it holds none'}); give one of"
                       " those, or leave the step out for the latest")
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
        for k, v in flatten_state(template).items()
    }
    quiet_abandoned_reads()
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(target), metadata=ocp.args.JsonRestore()),
    )
    _, treedef = jax.tree_util.tree_flatten(template)
    flat = restored["state"]
    state = jax.tree_util.tree_unflatten(treedef, [flat[k] for k in sorted(flat)])
    return state, dict(restored["metadata"])


def quiet_abandoned_reads() -> None:
  """Drops the unraisable ``RuntimeError: Event loop is closed`` reports of a restore that failed.

  When a restore fails (a damaged array), the reads it started still complete,
  each posting to orbax's event loop, closed by then; Python reports every post
  as an unraisable error with its traceback — dozens, before and after the
  restore's own error, which says all they could. Every other unraisable error
  goes to the hook installed before. Idempotent.
  """
  previous = sys.unraisablehook
  if getattr(previous, "drops_closed_loop_posts", False):
    return

  def hook(unraisable) -> None:
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
      return
    previous(unraisable)

  hook.drops_closed_loop_posts = True
  sys.unraisablehook = hook


def _this_process_only(ocp):
  """Orbax options that keep a read to this process: no barrier waits for processes that do not read."""
  if "jax" not in sys.modules or not _distributed_started():
    return ocp.options.MultiprocessingOptions()
  return ocp.options.MultiprocessingOptions(primary_host=jax.process_index(), active_processes={jax.process_index()})


def _distributed_started() -> bool:
  return distributed.global_state.client is not None


def read_checkpoints(directory: str | Path) -> dict[int, dict[str, Any]]:
  """Every complete checkpoint under ``directory`` and its metadata, read-only (nothing is created).

  A checkpoint whose metadata cannot be read maps to an empty dict, as does one whose metadata files are not
  regular files within ``METADATA_MAX_BYTES`` (a FIFO there would block the read).
  """
  path = Path(directory).absolute()
  if not path.is_dir():
    return {}
  absl_log = logging.getLogger("absl")
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)  # orbax announces read-only mode as a warning; it is what we asked for
  try:
    manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, max_to_keep=None,
        multiprocessing_options=_this_process_only(ocp)))
  finally:
    absl_log.setLevel(level)
  out = {}
  for step in manager.all_steps():
    try:
      for name in ("_CHECKPOINT_METADATA", "metadata/metadata"):  # what the read below opens
        if (path / str(step) / name).exists():
          check_regular(path / str(step) / name, what="checkpoint metadata", max_bytes=METADATA_MAX_BYTES)
      restored = manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
      out[int(step)] = dict(restored["metadata"])
    except Exception:  # pylint: disable=broad-except  # a foreign or damaged checkpoint still counts
      out[int(step)] = {}
  return out
