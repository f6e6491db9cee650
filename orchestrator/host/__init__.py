"""The process's host set-up, no JAX: the core plan (XLA's pool size, the host core), the cores other runs on
the machine claimed, and XLA's persistent compilation cache keyed by the host layout. Made before JAX starts.
"""
