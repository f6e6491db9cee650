"""Quantities in the unit that keeps them readable, for logs, plan reasons and reports."""

from __future__ import annotations


def format_seconds(x: float | None, *, zero: str | None = None) -> str:
  """Seconds in the unit that keeps them readable (µs, ms or s); ``zero``, where given, in place of a figure
  that would read 0.0 µs (a wait or an idle that means "nothing left to wait for", said in words)."""
  if x is None:
    return "-"
  if zero is not None and abs(x) < 0.05e-6:
    return zero
  if abs(x) < 1e-3:
    return f"{x * 1e6:.1f} µs"
  if abs(x) < 1:
    return f"{x * 1e3:.2f} ms"
  return f"{x:.3f} s"


def format_bytes(n: int | None) -> str:
  """Bytes in the binary unit that keeps them readable (B, KiB, MiB, GiB)."""
  if n is None:
    return "-"
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"
