"""Mesh axis sizes and the batch-split rule, without JAX (the recipe's ``mesh`` section is this type)."""

from __future__ import annotations

import dataclasses

AXES = ("fsdp", "context", "expert")
ROW_AXES = ("fsdp", "expert")
TOKEN_AXIS = "context"


@dataclasses.dataclass
class MeshConfig:
  """Sizes of the three mesh axes; their product is the number of devices used.

  Rows of a micro-batch split over ``fsdp`` × ``expert``, tokens over ``context``.
  """

  fsdp: int = 1
  context: int = 1
  expert: int = 1

  @property
  def num_devices(self) -> int:
    return self.fsdp * self.context * self.expert

  @property
  def row_shards(self) -> int:
    return self.fsdp * self.expert

  @classmethod
  def parse(cls, value: "MeshConfig | dict | None") -> "MeshConfig":
    if value is None:
      return cls()
    if isinstance(value, MeshConfig):
      return value
    unknown = sorted(set(value) - set(AXES))
    if unknown:
      raise ValueError(f"mesh: unknown axes {unknown}; the axes are {list(AXES)}")
    config = cls(**{k: int(v) for k, v in value.items()})
    config.validate()
    return config

  def validate(self) -> None:
    bad = {k: getattr(self, k) for k in AXES if not 1 <= getattr(self, k) <= 65_536}
    if bad:
      key, value = next(iter(bad.items()))
      raise ValueError(f"mesh.{key}={value} is out of range: it must be in [1, 65536]")

  def check_batch_shape(self, rows: int, tokens_per_row: int) -> None:
    """Raises ValueError unless rows split evenly over fsdp×expert and tokens over context."""
    if rows % self.row_shards:
      raise ValueError(f"batch.rows={rows} does not split over mesh.fsdp×mesh.expert={self.row_shards};"
                       f" use a multiple of {self.row_shards}")
    if tokens_per_row % self.context:
      raise ValueError(f"batch.tokens_per_row={tokens_per_row} does not split over mesh.context={self.context};"
                       f" use a multiple of {self.context}")
