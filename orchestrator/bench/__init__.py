"""Benchmarks (speed is measured here, never asserted in tests)."""
