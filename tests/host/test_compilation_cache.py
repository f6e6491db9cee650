"""Where compiled programs are cached: the user's cache directory unless the environment names one or says off,
one subdirectory per host layout."""

from __future__ import annotations

import pytest

from orchestrator.host.compilation_cache import compilation_cache_dir, default_cache_base, use_compilation_cache

pytestmark = pytest.mark.spec


def test_the_default_is_the_users_cache_directory(tmp_path):
  assert default_cache_base({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "step-boundary" / "xla"
  assert default_cache_base({}).parts[-3:] == (".cache", "step-boundary", "xla")


def test_off_turns_it_off_and_an_unwritable_place_leaves_it_off(tmp_path):
  assert use_compilation_cache({"STEP_BOUNDARY_COMPILATION_CACHE": "off"}) is None
  blocked = tmp_path / "a-file"
  blocked.write_text("")
  assert use_compilation_cache({"STEP_BOUNDARY_COMPILATION_CACHE": str(blocked / "cache")}) is None


def test_each_host_layout_has_its_own_directory(tmp_path):
  one = compilation_cache_dir(tmp_path, {"PJRT_NPROC": "1"})
  assert one == compilation_cache_dir(tmp_path, {"PJRT_NPROC": "1"})
  assert one != compilation_cache_dir(tmp_path, {"PJRT_NPROC": "2"})  # a pool's size changes the sums' bits
