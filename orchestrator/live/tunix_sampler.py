"""Tunix's sampler, with every static field of its sampling state a plain value.

Tunix 0.1.7's ``Sampler.init_sample_state`` keeps the prompt length (``num_input_tokens``) among the state's
static fields as a jax Array. Static fields are pytree metadata, and a tree's hash leaves its metadata out, so
the keys JAX's caches hold for one sampling program under different static settings (two temperatures, top_k
on and off) share one hash. When a cache evicts one of them, Python's dict finds it by comparing it with its
siblings of that hash, and the comparison reaches the two Arrays. An eviction happens on any insertion, so also
while some other function is being traced, and there the Arrays' ``==`` is staged into that trace: its result
cannot be a bool, and the trace fails (``TracerBoolConversionError``, "checking equality of metadata fields of
pytree") in whatever it was computing. A long process that samples and compiles fills the caches and meets it
at random. An int compares as a value anywhere, and every use Tunix makes of the field takes an int.
"""

from __future__ import annotations

from tunix.generate import sampler as sampler_lib


def with_plain_static_fields(state):
  """``state`` (Tunix's sampling state) with its prompt length an int rather than an Array."""
  return state.replace(num_input_tokens=int(state.num_input_tokens))


class Sampler(sampler_lib.Sampler):
  """Tunix's ``Sampler``, whose sampling states keep no Array in their static fields (the module says why)."""

  def init_sample_state(self, *args, **kwargs):
    return with_plain_static_fields(super().init_sample_state(*args, **kwargs))
