"""A run's files on disk, read back as the input they are, no JAX: what a run directory holds, claiming one,
its segments and reading it back (``run_dir``); a checkpoint's metadata (``checkpoint_check``) and the files its
params are read from (``checkpoint_state``), checked before a resume or an export trusts them.
"""
