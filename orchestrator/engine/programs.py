"""The engine's compiled programs: accumulate (capacity and dropless), apply, and the grad norm.

Jitted once per engine with its shardings and donation; compiled ahead of time
(``compile``) or dispatched through ``jax.jit`` (``aot=False``). The math is
in ``step_math``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax

from orchestrator.engine import step_math


class StepPrograms:
  """Jits the step math with the engine's shardings and keeps the compiled executables."""

  def __init__(self, graphdefs: dict[str, Any], loss_config, optimizer, *, rerun_dropped: bool,
               param_shardings, opt_shardings, scalar_sharding, batch_shardings, aot: bool, remat: str = "none",
               splash_mesh=None):
    self.aot = aot
    self.trace_counts = {"accumulate": 0, "accumulate_dropless": 0, "apply": 0}
    self.compile_s: dict[str, float] = {}
    self._compiled: dict[str, Any] = {}
    s, p = scalar_sharding, param_shardings
    # With a KL term the reference's params come last (never donated: every micro-batch reads them).
    reference = (p,) if loss_config.kl_beta else ()
    accumulate_kwargs = dict(in_shardings=(p, p, s, s, batch_shardings, *reference),
                             out_shardings=(p, s, s, s, s, s, s), donate_argnums=(1, 2, 3))
    programs = {"accumulate": (graphdefs["capacity"], rerun_dropped)}
    if rerun_dropped:
      programs["accumulate_dropless"] = (graphdefs["dropless"], False)
    self._jits = {
        name: jax.jit(step_math.accumulate_fn(graphdef, loss_config, mask_overflow=mask,
                                              on_trace=self._counter(name), remat=remat,
                                              splash_mesh=splash_mesh), **accumulate_kwargs)
        for name, (graphdef, mask) in programs.items()
    }
    self._jits["apply"] = jax.jit(
        step_math.apply_fn(optimizer, on_trace=self._counter("apply")),
        in_shardings=(p, opt_shardings, p, s, s),
        out_shardings=(p, opt_shardings, p, s, s, {"loss": s, "grad_norm": s, "tokens": s}),
        # Params (argument 0) are not donated: step k's weights stay readable while step k+1 runs.
        donate_argnums=(1, 2, 3, 4),
    )
    self.grad_norm = jax.jit(step_math.grad_norm, in_shardings=(p, s), out_shardings=s)

  def _counter(self, name: str):
    def count():
      self.trace_counts[name] += 1
    return count

  def compile(self, params, opt_state, accumulators: tuple, batch: dict, reference: tuple = ()) -> dict[str, float]:
    """Compiles every program for these argument shapes (``reference``: the reference's params, with a KL term),
    the programs side by side; a second call is a no-op. Returns each program's seconds (its tracing and its
    compile: the compiles overlap, so they add up to more than the wall time)."""
    if not self._compiled:
      args = {"accumulate": (params, *accumulators, batch, *reference),
              "accumulate_dropless": (params, *accumulators, batch, *reference),
              "apply": (params, opt_state, *accumulators)}
      lowered, lower_s = {}, {}
      for name, jitted in self._jits.items():  # tracing holds the interpreter: one program at a time
        start = time.perf_counter()
        lowered[name] = jitted.lower(*args[name])
        lower_s[name] = time.perf_counter() - start

      def compile_one(name):
        start = time.perf_counter()
        return name, lowered[name].compile(), time.perf_counter() - start

      # XLA compiles outside the interpreter's lock, so the programs compile side by side: a many-layer MoE's
      # two micro-batch programs take minutes each on an accelerator's compiler, one after the other.
      with concurrent.futures.ThreadPoolExecutor(max_workers=len(lowered)) as pool:
        for name, executable, seconds in pool.map(compile_one, lowered):
          self._compiled[name] = executable
          self.compile_s[name] = lower_s[name] + seconds
    return dict(self.compile_s)

  @property
  def compiled(self) -> bool:
    return bool(self._compiled)

  def get(self, name: str):
    """The program to dispatch: the compiled executable with ``aot``, else the jitted function."""
    if not self.aot:
      return self._jits[name]
    if name not in self._compiled:
      raise RuntimeError(f"program {name!r} is not compiled yet; call engine.compile() first")
    return self._compiled[name]
