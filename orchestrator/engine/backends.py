"""Engine backends by name: the registry a recipe's ``engine.backend`` picks from.

The names and where each builder lives are in ``options.BACKENDS`` (JAX-free, so
recipes validate without importing JAX). A builder takes the model preset, the
mesh, the batch shape, the checkpoint directory, ``micro_batches_per_step``,
the distribution the rollouts are sampled from (``sampled``) and the
``EngineOptions`` fields, and returns an object that satisfies
``orchestrator.contract.TrainingEngine``. A new backend is one module with a
builder plus one entry in ``BACKENDS``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from orchestrator.contract import TrainingEngine
from orchestrator.engine.options import BACKENDS, EngineOptions
from orchestrator.models.presets import ModelPreset

if TYPE_CHECKING:  # the loss module imports JAX; this registry stays JAX-free
  from orchestrator.engine.loss import SampledDistribution


def build_backend(preset: str | ModelPreset, options: EngineOptions, *, mesh: Mapping[str, int] | None = None,
                  rows: int | None = None, tokens_per_row: int | None = None,
                  checkpoint_dir: str | None = None, micro_batches_per_step: int = 1,
                  sampled: SampledDistribution | None = None) -> TrainingEngine:
  """Builds the engine ``options.backend`` names; ``sampled`` is the distribution its rollouts come from
  (``orchestrator.engine.loss``).

  Raises:
    ValueError: an unknown backend, or settings that backend cannot run.
  """
  if options.backend not in BACKENDS:
    raise ValueError(f"engine.backend={options.backend!r} is not a backend; use one of {sorted(BACKENDS)}")
  module, function = BACKENDS[options.backend].split(":")
  builder = getattr(importlib.import_module(module), function)
  fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name != "backend"}
  kwargs: dict[str, Any] = dict(mesh=mesh, rows=rows, tokens_per_row=tokens_per_row,
                                checkpoint_dir=checkpoint_dir, sampled=sampled, **fields)
  if options.backend != "jax":
    kwargs["micro_batches_per_step"] = micro_batches_per_step
  engine = builder(preset, **kwargs)
  if not isinstance(engine, TrainingEngine):
    raise TypeError(f"backend {options.backend!r} built a {type(engine).__name__}, which is not a TrainingEngine")
  return engine
