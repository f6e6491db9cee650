"""Reading the files a user names: regular files only, with a bound on their size.

A recipe names files (a checkpoint's ``config.json`` and safetensors, a prompt
set, a tokenizer, a recording); a run must never block on one or read one
without end. A FIFO opened for reading blocks until a writer appears, and a
character device such as ``/dev/zero`` has no end: both are refused by what
``fstat`` says of the opened descriptor, which is opened non-blocking so that
the open itself cannot hang. Every refusal is a ``UserFileError`` whose text
names the file, what it is and the fix.

This module imports nothing of the orchestrator, so every layer can use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

MIB = 1 << 20


class UserFileError(ValueError):
  """A named file that cannot be read as given (the text says which, why, and the fix)."""


def kind_of(mode: int) -> str:
  """What a file of ``mode`` (``st_mode``) is, in words: "a FIFO (named pipe)", "a directory", ..."""
  for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                     (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
    if test(mode):
      return name
  return "not a regular file"


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, *, what: str, max_bytes: int) -> Iterator[tuple[BinaryIO, int]]:
  """Opens ``path`` for binary reading if it is a regular file of at most ``max_bytes``.

  Yields ``(file, size_bytes)``. ``what`` names the file's role in the refusal
  ("the prompt set", "a safetensors file"). Links are followed: what counts is
  the file they reach.

  Raises:
    UserFileError: the file is missing, unreadable, not a regular file (a FIFO,
      a device, a socket, a directory), or larger than ``max_bytes``.
  """
  path = Path(path)
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
  except FileNotFoundError:
    raise UserFileError(f"{what} {path} does not exist: give the path of an existing file") from None
  except IsADirectoryError:
    raise UserFileError(f"{what} {path} is a directory: give the path of a regular file") from None
  except OSError as e:
    raise UserFileError(f"{what} {path} cannot be opened ({e.strerror}): give the path of a readable,"
                        " regular file") from None
  try:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      raise UserFileError(f"{what} {path} is {kind_of(info.st_mode)}, which a run would block on or read without"
                          " end: give the path of a regular file")
    if info.st_size > max_bytes:
      raise UserFileError(f"{what} {path} is {info.st_size:,} bytes, over the {max_bytes:,} bytes read for it:"
                          " give a smaller file")
    if hasattr(os, "O_NONBLOCK"):
      os.set_blocking(fd, True)
    file = os.fdopen(fd, "rb")
  except BaseException:
    os.close(fd)
    raise
  with file:
    yield file, info.st_size


def read_regular_bytes(path: str | os.PathLike, *, what: str, max_bytes: int) -> bytes:
  """The whole content of a regular file of at most ``max_bytes`` (see ``open_regular``)."""
  with open_regular(path, what=what, max_bytes=max_bytes) as (file, size_bytes):
    data = file.read(max_bytes + 1)
  if len(data) > max_bytes:  # it grew between fstat and the read
    raise UserFileError(f"{what} {path} grew past the {max_bytes:,} bytes read for it while it was read:"
                        " give a file that is not being written")
  return data


def read_regular_text(path: str | os.PathLike, *, what: str, max_bytes: int) -> str:
  """``read_regular_bytes`` decoded as UTF-8; text that is not UTF-8 is refused naming the byte offset."""
  data = read_regular_bytes(path, what=what, max_bytes=max_bytes)
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserFileError(f"{what} {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None


def check_regular(path: str | os.PathLike, *, what: str, max_bytes: int) -> int:
  """Checks, without reading it, that ``path`` is a regular file within ``max_bytes``; returns its size."""
  with open_regular(path, what=what, max_bytes=max_bytes) as (_, size_bytes):
    return size_bytes
