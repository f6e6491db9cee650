"""Files a user names are read only when they are regular files within a size bound: never block, never read without end."""

from __future__ import annotations

import os
import threading

import pytest

from orchestrator.user_files import UserFileError, check_regular, read_regular_bytes, read_regular_text

pytestmark = pytest.mark.spec


def test_a_regular_file_is_read_whole(tmp_path):
  path = tmp_path / "a.txt"
  path.write_text("héllo")
  assert read_regular_text(path, what="the file", max_bytes=100) == "héllo"
  assert check_regular(path, what="the file", max_bytes=100) == len("héllo".encode())


def test_a_fifo_is_refused_without_blocking(tmp_path):
  path = tmp_path / "prompts.jsonl"
  os.mkfifo(path)
  result = {}
  reader = threading.Thread(target=lambda: result.setdefault("error", _error(path)), daemon=True)
  reader.start()
  reader.join(timeout=10)
  assert not reader.is_alive(), "reading a FIFO blocked"
  assert "FIFO" in str(result["error"]) and str(path) in str(result["error"])


def _error(path):
  try:
    read_regular_bytes(path, what="the prompt set", max_bytes=1 << 20)
  except UserFileError as e:
    return e
  return None


def test_a_device_is_refused():
  with pytest.raises(UserFileError, match="character device"):
    read_regular_bytes("/dev/zero", what="the prompt set", max_bytes=1 << 20)


def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path):
  path = tmp_path / "big"
  path.write_bytes(b"x" * 101)
  with pytest.raises(UserFileError, match="101 bytes, over the 100"):
    read_regular_bytes(path, what="the file", max_bytes=100)
  assert read_regular_bytes(path, what="the file", max_bytes=101) == b"x" * 101  # negative control: at the bound


@pytest.mark.parametrize("make, words", [(lambda p: None, "does not exist"), (lambda p: p.mkdir(), "directory")])
def test_missing_and_directory_are_named(tmp_path, make, words):
  path = tmp_path / "x"
  make(path)
  with pytest.raises(UserFileError, match=words):
    read_regular_bytes(path, what="the file", max_bytes=10)


def test_text_that_is_not_utf8_names_the_byte(tmp_path):
  path = tmp_path / "a.txt"
  path.write_bytes(b"ok\xff")
  with pytest.raises(UserFileError, match="byte 2"):
    read_regular_text(path, what="the file", max_bytes=10)
