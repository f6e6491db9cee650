"""The layering and size rules the code keeps (docs/design.md §3), checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "policies", "integrations")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def _sources():
  for package in PACKAGES:
    yield from sorted((REPO / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def _too_long(path: Path, root: Path = REPO) -> list[str]:
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    limit = {ast.FunctionDef: MAX_FUNCTION_LINES, ast.AsyncFunctionDef: MAX_FUNCTION_LINES,
             ast.ClassDef: MAX_CLASS_LINES}.get(type(node))
    if limit is not None:
      lines = node.end_lineno - node.lineno + 1
      if lines > limit:
        out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} is {lines} lines (limit {limit})")
  return out


def test_no_function_or_class_is_too_long():
  assert [msg for path in _sources() for msg in _too_long(path)] == []


def test_the_size_check_catches_a_long_function(tmp_path):
  """Negative control: the checker itself flags an 81-line function."""
  body = "\n".join(f"  x{i} = {i}" for i in range(80))
  path = tmp_path / "long.py"
  path.write_text(f"def f():\n{body}\n")
  assert len(_too_long(path, root=tmp_path)) == 1


@pytest.mark.parametrize("path", sorted((REPO / "orchestrator" / "data").rglob("*.py")),
                         ids=lambda p: p.name)
def test_data_imports_nothing_from_the_engine(path):
  assert not [n for n in _imports(path) if n.startswith("orchestrator.engine")]


@pytest.mark.parametrize("name", ["program.py", "recorder.py", "trainer_worker.py", "contract.py",
                                  "watcher.py", "trace.py"])
def test_program_side_imports_nothing_from_the_engine(name):
  path = REPO / "orchestrator" / ("contract.py" if name == "contract.py" else f"loop/{name}")
  assert not [n for n in _imports(path) if n.startswith("orchestrator.engine")]


def test_policies_import_neither_jax_nor_the_orchestrator():
  for path in sorted((REPO / "policies").rglob("*.py")):
    bad = [n for n in _imports(path) if n.split(".")[0] in ("jax", "orchestrator", "numpy")]
    assert not bad, f"{path.name} imports {bad}"


def test_code_cites_the_design_in_the_repository():
  assert (REPO / "docs" / "design.md").is_file()
  for path in _sources():
    assert "DESIGN.md" not in path.read_text(), f"{path} cites a design file the repository lacks"
