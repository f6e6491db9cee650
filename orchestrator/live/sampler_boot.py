"""The sampler's process, its side: the environment set before anything there imports JAX, then the requests.

JAX reads ``JAX_PLATFORMS`` when it is imported, and XLA's CPU client its pool
size (``PJRT_NPROC``) when it starts, so the child must have both before its
first import of JAX. This module imports nothing that imports JAX, and the
sampler's specification arrives pickled, to be loaded (importing JAX with it)
only once the environment is set. The parent's environment is never changed:
other threads of a running trainer read it, and other children it starts
inherit it. ``sampler_process.SamplerProcess`` is the parent's side.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback

#: The child's scheduling priority below its parent's. The host core is shared: the trainer's thread sleeps in
#: ``wait_for_device`` while its last micro-batch computes, and a staged boundary's update is dispatched only
#: once that thread runs again. At its parent's priority the sampler held the core for milliseconds after the
#: wait ended (staged steps measured 7 ms slower than controls); below it, the waking thread takes the core at
#: once, and the sampler keeps every moment the trainer's thread does not use.
SAMPLER_NICE = 10


def serve(conn, spec_bytes: bytes, environment: dict[str, str]) -> None:
  """The child: sets ``environment`` (and, unless it names one, an XLA pool sized to this process's cores), builds
  the sampler the pickled ``SamplerSpec`` describes, and answers requests until told to close or the pipe
  closes."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us
  os.nice(SAMPLER_NICE)
  os.environ.update(environment)
  if "PJRT_NPROC" not in environment and hasattr(os, "sched_getaffinity"):
    os.environ["PJRT_NPROC"] = str(len(os.sched_getaffinity(0)))  # an XLA pool sized to the cores it may run on
  try:
    # import here: JAX starts with the environment above (the spec's modules import it too)
    import jax

    from orchestrator.host.compilation_cache import use_compilation_cache
    from orchestrator.live.sampler import LiveSampler

    spec = pickle.loads(spec_bytes)
    use_compilation_cache()
    sampler = LiveSampler(spec.preset, spec.model.tokenizer(), seed=spec.seed,
                          max_prompt_length=spec.max_prompt_length,
                          max_generation_steps=spec.max_generation_steps, alphabet=spec.alphabet,
                          dtype=spec.dtype, routing=spec.routing)
    treedef, shapes = sampler.weights_structure, sampler.weight_shapes
    conn.send(("ok", {"platform": jax.default_backend(), "jax_platforms": str(jax.config.jax_platforms)}))
  except BaseException:
    conn.send(("error", traceback.format_exc()))
    return
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):  # the parent is gone
      return
    kind = message[0]
    if kind == "close":
      return
    try:
      if kind == "sync":
        leaves = message[1]
        sent = [tuple(leaf.shape) for leaf in leaves]
        if sent != shapes:
          raise ValueError(f"sync sent weights of shapes {sent}; the sampler's model has {shapes}")
        sampler.sync(jax.tree.unflatten(treedef, leaves), 0)
        answer = None
      elif kind == "sample":
        prompts, seed, temperature, top_p, top_k, stop, max_new_tokens = message[1:]
        answer = sampler.sample(prompts, seed=seed, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop,
                                max_new_tokens=max_new_tokens)
      elif kind == "greedy":
        answer = sampler.greedy(message[1], stop=message[2], max_new_tokens=message[3])
      else:
        raise ValueError(f"unknown request {kind!r}")
      conn.send(("ok", answer))
    except BaseException:
      conn.send(("error", traceback.format_exc()))
