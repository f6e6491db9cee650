"""``run_rl simulate --from RUN_DIR --recipe OTHER.yaml --probe``: the device compute at both jobs' shapes, timed here.

The scaling rules (``policies.boundary_model.SCALING``) take a micro-batch's
compute as proportional to the tokens each device holds. Hardware need not
follow that at the sizes in question: on the 2-core CPU this project is tested
on, a tiny-model run's micro-batch cost 1.7-2.1x as much at 16 rows of 64
tokens as at 8, 2.9-3.4x at 32 as at 16 and 2.5-3.0x at 64 as at 32 (two
samples; halving the vocabulary leaves the step between 16 and 32 rows where it
is, so it is not the logits'). No
proportional rule predicts that; a measurement of the model at both shapes does.

The probe builds the model at the run's and at the other job's per-device shape
on this machine's first device, times its micro-batch and its update at each
(in turn, step by step, medians over ``repeats``), and scales the
fitted compute by the measured ratio. The ratio is used, not the probe's own
seconds: the run measured its compute under its own load and threads, the probe
says only how that compute changes with the shape.

Limits (each said in the rule the prediction cites): one device holding the
job's per-device share of a micro-batch (rows over the devices that split rows,
tokens over ``context``) and the whole model, so a mesh's collectives are not
timed and the update's ratio is taken to each device's shard of the weights by
the rule's 1 / devices; synthetic inputs and random weights (an MoE's routing
load is the synthetic one); the other job's hardware is this machine's. A model
too large for the first device is refused before anything is built.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from orchestrator.host.host_threads import apply_core_plan, release_core_plan
from policies.boundary_model import Components, Estimate, JobShape, ScaledChange, consistent

#: The components the probe scales, and the ``ShapeProbe`` measurement each one scales by.
PROBED = {"micro_batch_s": "micro_batch_s", "rerun_s": "micro_batch_s", "update_s": "update_s"}


@dataclasses.dataclass(frozen=True)
class ShapeProbe:
  """One job shape timed on one device of this machine (seconds, medians)."""

  rows: int  # per device
  tokens_per_row: int
  micro_batch_s: float
  update_s: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def per_device_shape(shape: JobShape, where: str) -> tuple[int, int]:
  """The rows and tokens per row one device holds in ``shape`` (rows split over the devices that do not split
  tokens, tokens over ``context``, as ``orchestrator.engine.mesh`` places them): what the probe times.

  Raises:
    ValueError: the rows or the tokens do not split evenly.
  """
  row_devices = shape.devices // shape.context
  if shape.rows % row_devices or shape.tokens_per_row % shape.context:
    raise ValueError(f"simulate --probe: {where} has {shape.rows} rows of {shape.tokens_per_row} tokens per"
                     f" micro-batch, which do not split evenly over {row_devices} devices for rows and {shape.context}"
                     " for tokens; the probe times one device's share — use a batch the mesh divides")
  return shape.rows // row_devices, shape.tokens_per_row // shape.context


def parameter_count(preset) -> int:
  """The Qwen3 shape's weights: attention, the MLP (or the experts and their router), norms, the embeddings."""
  attention = preset.embed_dim * preset.head_dim * (2 * preset.num_heads + 2 * preset.num_kv_heads)
  experts = preset.num_experts or 1
  mlp = experts * 3 * preset.embed_dim * preset.hidden_dim + (preset.embed_dim * experts if preset.is_moe else 0)
  norms = 2 * preset.embed_dim + 2 * preset.head_dim
  embeddings = preset.vocab_size * preset.embed_dim * (1 if preset.use_tied_embedding else 2)
  return preset.num_layers * (attention + mlp + norms) + embeddings + preset.embed_dim


def training_bytes(preset, rows: int, tokens_per_row: int) -> int:
  """About what one device needs to train ``preset`` at this shape in float32: weights, gradients and two
  optimizer moments (16 bytes a weight), and the activations a backward pass keeps (per token and layer the
  residual stream, attention and MLP values; the logits three times)."""
  tokens = rows * tokens_per_row
  per_token_layer = 12 * preset.embed_dim + 3 * preset.hidden_dim * (preset.num_experts_per_tok or 1)
  activations = tokens * (preset.num_layers * per_token_layer + 3 * preset.vocab_size)
  return 16 * parameter_count(preset) + 4 * activations


def _memory_here_bytes() -> tuple[int | None, str]:
  """The first device's memory limit where the runtime reports one, else the host's available memory."""
  import jax  # import here: after ``probe_both`` kept the host core, as the run did

  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"{jax.devices()[0].device_kind}'s memory"
  try:
    with open("/proc/meminfo") as f:
      kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib * 1024, "this machine's available memory"
  except (OSError, StopIteration, ValueError):
    return None, "unknown"


def check_fits(recipe, shape: JobShape, *, where: str) -> None:
  """Refuses, before anything is built, a shape whose training would not fit this machine's first device.

  Raises:
    ValueError: the estimate (``training_bytes``) exceeds 80 % of the memory there.
  """
  preset, (rows, tokens_per_row) = recipe.model_preset(), per_device_shape(shape, where)
  need = training_bytes(preset, rows, tokens_per_row)
  have, what = _memory_here_bytes()
  if have is not None and need > 0.8 * have:
    raise ValueError(f"simulate --probe: {where}'s model {preset.name} at {rows} x {tokens_per_row} tokens per"
                     f" device needs about {need / 2**30:,.1f} GiB to train, more than 80 % of {what}"
                     f" ({have / 2**30:,.1f} GiB); probe on a machine that holds it, or drop --probe to scale by the"
                     " rules")


class _ShapeUnderTest:
  """One shape's engine and inputs: a micro-batch and an update, each timed from dispatch to ready."""

  def __init__(self, recipe, shape: JobShape, where: str):
    from orchestrator.data.synthetic import SyntheticRollouts  # import here: they import JAX, after the host core
    from orchestrator.engine import build_engine  # is kept (``probe_both``)

    self.where, self.preset = where, recipe.model_preset()
    self.rows, self.tokens_per_row = per_device_shape(shape, where)
    options = {f.name: getattr(recipe.engine, f.name) for f in dataclasses.fields(recipe.engine)
               if f.name != "backend"}
    self.engine = build_engine(self.preset, rows=self.rows, tokens_per_row=self.tokens_per_row, **options)
    self.source = SyntheticRollouts(self.preset.vocab_size, self.rows, self.tokens_per_row, seed=1,
                                    routing=recipe.engine.routing_shape(self.preset))
    self.micro_batch_s: list[float] = []
    self.update_s: list[float] = []

  def time_one_step(self, step: int) -> None:
    import jax  # import here: see __init__

    prepared = self.engine.prepare_fwd_bwd_input(self.source.micro_batch(step, 0))
    jax.block_until_ready(prepared.arrays)  # the input on the device: only the compute is timed
    start = time.perf_counter()
    self.engine.fwd_bwd(prepared).ready.block_until_ready()
    self.micro_batch_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    self.engine.update().ready.block_until_ready()
    self.update_s.append(time.perf_counter() - start)

  def result(self) -> ShapeProbe:
    return ShapeProbe(self.rows, self.tokens_per_row, statistics.median(self.micro_batch_s),
                      statistics.median(self.update_s))


def probe_both(source_recipe, source: JobShape, target_recipe, target: JobShape, *,
               repeats: int = 15) -> tuple[ShapeProbe, ShapeProbe]:
  """The run's shape and the other job's, timed in turn step by step in this process (medians over ``repeats``
  after one warm-up step each), so a change in the machine's load between them moves both alike.

  The cores are planned first as the run planned them (``run.reserve_host_core``; a no-op once JAX has started
  in this process).

  Raises:
    ValueError: a shape the mesh does not divide, a model the first device cannot hold, or the runtime failed
      while probing (out of memory, most likely), in one line.
  """
  apply_core_plan(source_recipe.run.reserve_host_core, among_runs=False)
  try:
    return _probe_on_planned_cores(source_recipe, source, target_recipe, target, repeats)
  finally:
    release_core_plan()  # the process's cores as they were


def _probe_on_planned_cores(source_recipe, source: JobShape, target_recipe, target: JobShape,
                            repeats: int) -> tuple[ShapeProbe, ShapeProbe]:
  check_fits(source_recipe, source, where="the run")
  check_fits(target_recipe, target, where="the other job")
  shapes: list[_ShapeUnderTest] = []
  where = "the run"
  try:
    shapes.append(_ShapeUnderTest(source_recipe, source, where))
    where = "the other job"
    shapes.append(_ShapeUnderTest(target_recipe, target, where))
    for step in range(repeats + 1):
      for shape in shapes:
        where = shape.where
        shape.time_one_step(step)
  except (RuntimeError, MemoryError) as e:  # XLA's errors are RuntimeErrors; the first line says what failed
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise ValueError(f"simulate --probe: probing {where}'s model failed on this machine ({first_line}); drop"
                     " --probe to scale by the rules") from e
  for shape in shapes:  # the first step of each compiled and warmed up its programs
    del shape.micro_batch_s[0], shape.update_s[0]
  return shapes[0].result(), shapes[1].result()


def apply_probe(fitted: Components, scaled: Estimate, changes: list[ScaledChange], source: JobShape,
                target: JobShape, source_probe: ShapeProbe, target_probe: ShapeProbe
                ) -> tuple[Estimate, list[ScaledChange]]:
  """``scaled`` (the fit taken to the other job by the rules) with the probed components scaled from ``fitted``
  by the probe's ratio instead, each change citing both measurements and the rule it replaces.

  The probe times the whole model on one device, so the update's ratio is taken to each job's shard of the
  weights (``source.devices / target.devices``, the rule's 1 / devices) on top.
  """
  by_component = {ch.component: ch for ch in changes}
  values, sources = {}, dict(scaled.sources)
  kept = [ch for ch in changes if ch.component not in PROBED]
  for name, measurement in PROBED.items():
    before, after = getattr(source_probe, measurement), getattr(target_probe, measurement)
    rule = by_component.get(name)
    if not getattr(fitted, name) or not before:
      kept += [rule] if rule else []  # nothing to scale by: the rule's value stands, and says so
      continue
    shard = source.devices / target.devices if name == "update_s" else 1.0
    factor = after / before * shard
    values[name] = getattr(fitted, name) * factor
    sources[name] = f"{scaled.sources.get(name, 'default')}, scaled by the probe"
    instead = rule.rule if rule else "the rules, which leave it as it is"
    kept.append(ScaledChange(name, factor, f"probed on one device of this machine: {before * 1e3:.3f} ms at the"
                             f" run's {source_probe.rows} x {source_probe.tokens_per_row} tokens per device,"
                             f" {after * 1e3:.3f} ms at {target_probe.rows} x {target_probe.tokens_per_row}"
                             + (f", x{shard:.3g} for each device's shard of the weights" if shard != 1.0 else "")
                             + f": x{factor:.3g}, collectives not timed (instead of {instead})"))
  components = consistent(dataclasses.replace(scaled.components, **values))
  return Estimate(components, sources, scaled.unknowns), kept
