"""The layering and size rules the code keeps (docs/design.md §3), checked on the source."""

from __future__ import annotations

import ast
import re
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "policies", "integrations")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300
#: A class keeps this far below its limit: the limit is a smell detector, and a class that grows towards it is
#: split by concern, not trimmed to fit (docs/design.md §3).
CLASS_MARGIN_LINES = 10


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


def _class_lines(node: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> int:
  """A class's lines together with those of its bases defined in the same module (each once, through their own
  bases too): a base that holds a class's methods and reads its state is the same class, split only on paper."""
  seen, lines, todo = set(), 0, [node]
  while todo:
    klass = todo.pop()
    if klass.name in seen:
      continue
    seen.add(klass.name)
    lines += klass.end_lineno - klass.lineno + 1
    todo.extend(classes[b.id] for b in klass.bases if isinstance(b, ast.Name) and b.id in classes)
  return lines


def _too_long(path: Path, root: Path = REPO) -> list[str]:
  out = []
  tree = ast.parse(path.read_text())
  classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
  for node in ast.walk(tree):
    limit = {ast.FunctionDef: MAX_FUNCTION_LINES, ast.AsyncFunctionDef: MAX_FUNCTION_LINES,
             ast.ClassDef: MAX_CLASS_LINES - CLASS_MARGIN_LINES}.get(type(node))
    if limit is not None:
      lines = (_class_lines(node, classes) if isinstance(node, ast.ClassDef)
               else node.end_lineno - node.lineno + 1)
      if lines > limit:
        out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} is {lines} lines (limit {limit})")
  return out


@pytest.mark.spec
def test_no_function_is_too_long_and_no_class_near_its_limit():
  assert [msg for path in _sources() for msg in _too_long(path)] == []


@pytest.mark.spec
def test_the_size_check_catches_a_long_function_and_a_class_near_its_limit(tmp_path):
  """Negative control: an 81-line function, and a class 5 lines under the class limit."""
  body = "\n".join(f"  x{i} = {i}" for i in range(80))
  path = tmp_path / "long.py"
  path.write_text(f"def f():\n{body}\n")
  assert len(_too_long(path, root=tmp_path)) == 1
  methods = "\n".join(f"  def m{i}(self):\n    return {i}\n" for i in range((MAX_CLASS_LINES - 5) // 3))
  path.write_text(f"class C:\n{methods}")
  assert len(_too_long(path, root=tmp_path)) == 1


@pytest.mark.spec
def test_the_size_check_counts_a_class_with_its_bases_in_the_same_module(tmp_path):
  """Negative control shaped like a source that came under the limit by moving methods into a base beside it
  that reads its state: 5 lines under the limit alone, over it with that base (or with the base's own base), it
  is caught, and the base alone is not; on a base from another module it is under the limit."""
  def methods(prefix: str, count: int) -> str:
    return "\n".join(f"  def {prefix}{i}(self):\n    return self._state\n" for i in range(count))

  source = f"class Source(_Held):\n{methods('own', (MAX_CLASS_LINES - CLASS_MARGIN_LINES - 5) // 3)}"
  held = f"class _Held:\n  _state: int\n\n{methods('held', 7)}\n\n"
  path = tmp_path / "split.py"

  def caught(text: str) -> list[str]:
    path.write_text(text)
    return [m.split(" ", 1)[1].split(" is ")[0] for m in _too_long(path, root=tmp_path)]

  assert caught(held + source) == ["Source"]
  assert caught("class _Base:\n  pass\n\n\n" + held.replace("_Held:", "_Held(_Base):") + source) == ["Source"]
  assert caught(f"from elsewhere import _Held\n\n\n{source}") == []


def _private_classes_taken(path: Path, root: Path = REPO) -> list[str]:
  """Module-level functions with a parameter annotated by a private class imported from another module: the
  mark of a method hoisted out of its class with the class's state passed back in."""
  tree = ast.parse(path.read_text())
  imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
              for alias in node.names if (alias.asname or alias.name).startswith("_")}
  out = []
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
      for arg in args:
        nodes = list(ast.walk(arg.annotation)) if arg.annotation else []
        by_name = {n.id for n in nodes if isinstance(n, ast.Name)} & imported  # from m import _State
        by_module = {n.attr for n in nodes if isinstance(n, ast.Attribute)}  # m._State
        taken = sorted(n for n in by_name | by_module if n.startswith("_") and n[1:2].isupper())
        if taken:
          out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}({arg.arg}: {taken[0]})")
  return out


@pytest.mark.spec
def test_no_module_function_takes_another_modules_private_class():
  assert [msg for path in _sources() for msg in _private_classes_taken(path)] == []


@pytest.mark.spec
def test_the_private_class_check_catches_a_hoisted_method(tmp_path):
  """Negative control: imported by name and reached through its module, each is caught; a public class and a
  module's own private class are not."""
  path = tmp_path / "hoisted.py"
  path.write_text("from elsewhere import _State, State\nimport elsewhere\n\n\nclass _Own:\n  pass\n\n\n"
                  "def a(state: _State): ...\n"
                  "def c(state: elsewhere._State): ...\ndef d(state: State, own: _Own): ...\n")
  assert [m.split(" ", 1)[1] for m in _private_classes_taken(path, root=tmp_path)] == [
      "a(state: _State)", "c(state: _State)"]


@pytest.mark.spec
@pytest.mark.parametrize("path", sorted((REPO / "orchestrator" / "data").rglob("*.py")),
                         ids=lambda p: p.name)
def test_data_imports_nothing_from_the_engine(path):
  assert not [n for n in _imports(path) if n.startswith("orchestrator.engine")]


@pytest.mark.spec
@pytest.mark.parametrize("path", sorted([*(REPO / "orchestrator" / "loop").rglob("*.py"),
                                         *(REPO / "orchestrator" / "contract").rglob("*.py")]),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_loop_and_the_contract_import_nothing_from_the_engine(path):
  assert not [n for n in _imports(path) if n.startswith("orchestrator.engine")]


@pytest.mark.spec
def test_policies_import_neither_jax_nor_the_orchestrator():
  for path in sorted((REPO / "policies").rglob("*.py")):
    bad = [n for n in _imports(path) if n.split(".")[0] in ("jax", "orchestrator", "numpy")]
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.spec
def test_code_cites_the_design_in_the_repository():
  assert (REPO / "docs" / "design.md").is_file()
  for path in _sources():
    assert "DESIGN.md" not in path.read_text(), f"{path} cites a design file the repository lacks"


# ---------------------------------------------------------------- the import graph
def _module_name(path: Path) -> str:
  parts = path.relative_to(REPO).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in _sources()}


@dataclasses.dataclass(frozen=True)
class _Import:
  target: str  # the project module imported
  line: int
  in_function: bool
  marked: bool  # carries "# import here: <why>" (or follows, in one run, an import that does)


def _comment_above(lines: list[str], lineno: int) -> str:
  """The run of comment lines right above line ``lineno`` (1-based)."""
  above = []
  for line in reversed(lines[:lineno - 1]):
    if not line.strip().startswith("#"):
      break
    above.append(line)
  return "\n".join(above)


def _project_imports(path: Path) -> list[_Import]:
  """Every import of a project module in ``path``, at any depth; ``from X import Y`` names X.Y when that
  is a module."""
  text = path.read_text()
  lines = text.splitlines()
  found: list[_Import] = []

  def target(name: str) -> str | None:
    while name and name not in MODULES:
      name = name.rpartition(".")[0]
    return name or None

  def visit(node, in_function: bool, previous_end: list):
    for child in ast.iter_child_nodes(node):
      nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        here = "# import here:" in lines[child.lineno - 1] or "# import here:" in _comment_above(lines, child.lineno)
        gap = lines[previous_end[0]:child.lineno - 1] if previous_end[0] else ["x"]
        follows = previous_end[1] and all(not s.strip() or s.strip().startswith("#") for s in gap)
        marked = here or follows
        previous_end[:] = [child.end_lineno, marked]
        if isinstance(child, ast.Import):
          names = [a.name for a in child.names]
        elif child.module and child.level == 0:
          names = [f"{child.module}.{a.name}" if f"{child.module}.{a.name}" in MODULES else child.module
                   for a in child.names]
        else:
          names = []
        # A non-project import inside a function needs its reason too: recorded with target None.
        targets = [target(n) for n in names] or [None]
        found.extend(_Import(t, child.lineno, nested, marked) for t in targets)
      visit(child, nested, previous_end)

  visit(ast.parse(text), False, [0, False])
  return found


def _graph(*, module_level_only: bool) -> dict[str, set[str]]:
  return {name: {i.target for i in _project_imports(path)
                 if i.target and i.target != name and not (module_level_only and i.in_function)}
          for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  out: list[list[str]] = []

  def connect(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      connect(v)
  return out


@pytest.mark.spec
def test_no_import_circle_among_the_projects_modules():
  """No circle, counting imports inside functions too: a deferred import that closes one is still one."""
  assert _cycles(_graph(module_level_only=False)) == []


def _folder(module: str) -> str:
  """The folder a module sits in, at the depth the layers name (``orchestrator.loop.program`` → ``orchestrator.loop``)."""
  parts = module.split(".")
  return ".".join(parts[:2]) if parts[0] == "orchestrator" else parts[0]


@pytest.mark.spec
def test_no_import_circle_among_the_projects_folders():
  """At folder scale too: two folders never import each other, even through a third."""
  folders: dict[str, set[str]] = {}
  for module, targets in _graph(module_level_only=False).items():
    folders.setdefault(_folder(module), set()).update(_folder(t) for t in targets if _folder(t) != _folder(module))
  assert _cycles(folders) == []


@pytest.mark.spec
def test_the_circle_check_finds_a_circle():
  """Negative control."""
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: The layers, lowest first: a module imports from its own layer or below (docs/design.md §3).
LAYERS = (
    ("policies",),
    ("orchestrator.contract", "orchestrator.addresses", "orchestrator.user_files", "orchestrator.phases"),
    ("orchestrator.host", "orchestrator.models", "orchestrator.tasks"),
    ("orchestrator.data", "orchestrator.distributed"),
    ("orchestrator.engine", "orchestrator.live", "orchestrator.loop"),
    ("orchestrator.recipe", "orchestrator.remote"),
    ("orchestrator.assembly",),
    ("orchestrator.app", "orchestrator.run_files", "orchestrator.rig", "integrations"),
    ("orchestrator.bench",),
)
#: The imports that run back up the layers, each named in the design (at most one).
UPWARD_IMPORTS: set[tuple[str, str]] = set()


def _layer(module: str) -> int | None:
  for i, names in enumerate(LAYERS):
    if any(module == n or module.startswith(n + ".") for n in names):
      return i
  return None


@pytest.mark.spec
def test_every_module_has_a_layer():
  assert [m for m in MODULES if m not in ("orchestrator",) and _layer(m) is None] == []


@pytest.mark.spec
def test_imports_run_down_the_layers():
  """Counting imports inside functions too."""
  up = {(m, t) for m, targets in _graph(module_level_only=False).items() for t in targets
        if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)}
  assert up == UPWARD_IMPORTS and len(UPWARD_IMPORTS) <= 1


@pytest.mark.spec
@pytest.mark.parametrize("package", ["orchestrator.loop", "orchestrator.engine", "orchestrator.data",
                                     "orchestrator.live", "orchestrator.remote", "orchestrator.distributed",
                                     "orchestrator.contract", "orchestrator.recipe", "orchestrator.assembly",
                                     "orchestrator.run_files", "orchestrator.rig", "integrations"])
def test_the_library_never_imports_the_application(package):
  """Not even inside a function: the application builds on the library and the factory, never the other way;
  the rig and the Tunix add-on build their objects through orchestrator.assembly, not through the app."""
  bad = [(name, i.target) for name, path in MODULES.items() if name.startswith(package)
         for i in _project_imports(path) if i.target and i.target.startswith("orchestrator.app")]
  assert bad == []


@pytest.mark.spec
def test_nothing_in_remote_imports_the_rig_or_the_application():
  bad = [(name, i.target) for name, path in MODULES.items() if name.startswith("orchestrator.remote")
         for i in _project_imports(path) if i.target and i.target.startswith(("orchestrator.rig", "orchestrator.app"))]
  assert bad == []


@pytest.mark.spec
def test_the_remote_client_takes_its_types_from_the_contract_not_the_local_worker():
  targets = {i.target for i in _project_imports(MODULES["orchestrator.remote.client"])}
  assert not [t for t in targets if t and t.startswith("orchestrator.loop")]


@pytest.mark.spec
@pytest.mark.parametrize("name", ["orchestrator.loop.program", "orchestrator.loop.recorder"])
def test_the_program_and_the_recorder_probe_nothing_by_name(name):
  """They reach the source through StepSource / LiveSource and the worker through Worker, never getattr."""
  assert "getattr(" not in MODULES[name].read_text()


@pytest.mark.spec
def test_imports_sit_at_the_top_unless_a_comment_says_why():
  unmarked = [f"{_module_name(path)}:{i.line}" for path in _sources() for i in _project_imports(path)
              if i.in_function and not i.marked]
  assert unmarked == []


@pytest.mark.spec
def test_the_import_check_catches_an_unexplained_function_level_import(tmp_path, monkeypatch):
  """Negative control: one unmarked, one marked, one in the marked one's run."""
  path = tmp_path / "orchestrator" / "probe.py"
  path.parent.mkdir()
  path.write_text("def f():\n  import json\n\n\ndef g():\n  import jax  # import here: a reason\n"
                  "  import numpy\n")
  monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
  found = [(i.line, i.marked) for i in _project_imports(path) if i.in_function]
  assert found == [(2, False), (6, True), (7, True)]


@pytest.mark.e2e
def test_the_loop_the_contract_the_recipe_and_the_remote_client_import_no_jax():
  """A run is validated, and a remote trainer's driver runs, without JAX; the function-level imports above
  exist for this."""
  code = ("import sys\nimport orchestrator.loop.program, orchestrator.loop.recorder, orchestrator.contract\n"
          "import orchestrator.recipe, orchestrator.remote.client, orchestrator.app.cli, orchestrator.app.launch\n"
          "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('jax', 'grain')))\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------- the maps held to the code
DESIGN = REPO / "docs" / "design.md"
_ENTRY = re.compile(r"^( *)([A-Za-z_][\w]*)(/|\.py)(\s|$)")


def _design_section(text: str, title: str) -> str:
  start = text.index(f"\n## {title}")
  end = text.find("\n## ", start + 1)
  return text[start:end if end != -1 else len(text)]


def _layout_sections(block: str) -> dict[str, str]:
  """The layout block's text under each entry, keyed by its path (``orchestrator/engine``,
  ``orchestrator/assembly.py``): the entry's line and the lines below it, up to the next entry as far left."""
  lines = block.splitlines()
  sections: dict[str, str] = {}
  stack: list[tuple[int, str]] = []
  for i, line in enumerate(lines):
    m = _ENTRY.match(line)
    if not m:
      continue
    indent = len(m.group(1))
    while stack and stack[-1][0] >= indent:
      stack.pop()
    path = "/".join([*(name for _, name in stack), m.group(2)]) + (".py" if m.group(3) == ".py" else "")
    if m.group(3) == "/":
      stack.append((indent, m.group(2)))
    body = [line]
    for later in lines[i + 1:]:
      other = _ENTRY.match(later)
      if other and len(other.group(1)) <= indent:
        break
      body.append(later)
    sections[path] = "\n".join(body)
  return sections


def _unnamed_modules(block: str, modules: list[str]) -> list[str]:
  """The modules (dotted names) the layout block does not name: a top-level module by its own entry, any
  other as ``name.py`` in its folder's section (a bare word such as "the run" names nothing)."""
  sections = _layout_sections(block)
  missing = []
  for module in modules:
    parts = module.split(".")
    folder, stem = "/".join(parts[:-1]), parts[-1]
    if folder == "orchestrator" and f"orchestrator/{stem}.py" in sections:
      continue
    if not re.search(rf"(?<![\w.]){re.escape(stem)}\.py(?!\w)", sections.get(folder, "")):
      missing.append(module)
  return missing


def _package_modules() -> list[str]:
  return sorted(m for m, path in MODULES.items() if path.name != "__init__.py")


def _layout_block() -> str:
  section = _design_section(DESIGN.read_text(), "3. Layout and layering")
  return section.split("```")[1]


def _layer_table(text: str | None = None) -> list[tuple[str, ...]]:
  """The packages in each row of design §3's layer table (of ``text``, else the design's)."""
  section = _design_section(DESIGN.read_text() if text is None else text, "3. Layout and layering")
  rows = re.findall(r"^\| (\d+) \| (.*) \|$", section, flags=re.M)
  return [tuple(name for name in re.findall(r"`([\w.]+)`", cells)
                if name in ("policies", "integrations") or name.startswith("orchestrator.")) for _, cells in rows]


@pytest.mark.spec
def test_the_designs_layer_table_is_the_layers_this_test_checks():
  assert _layer_table() == [tuple(names) for names in LAYERS]


@pytest.mark.spec
def test_the_designs_layout_block_names_every_module():
  assert _unnamed_modules(_layout_block(), _package_modules()) == []


@pytest.mark.spec
def test_the_map_checks_catch_a_module_left_out_and_a_layer_moved():
  """Negative controls: a module the block does not name under its folder, one named only under another
  folder, one whose name is only a word in its folder's text; and the design with one package moved a layer
  down, which the layer check must tell from the layers."""
  block = ("orchestrator/\n  loop/   the loop, its feed\n    program.py  RLProgram\n  engine/  the engine (model.py)\n"
           "  assembly.py  the factory\n")
  modules = ["orchestrator.loop.program", "orchestrator.loop.feed", "orchestrator.engine.model",
             "orchestrator.engine.program", "orchestrator.assembly", "orchestrator.phases"]
  assert _unnamed_modules(block, modules) == ["orchestrator.loop.feed", "orchestrator.engine.program",
                                              "orchestrator.phases"]
  text = DESIGN.read_text()
  moved = text.replace("| `orchestrator.data`, `orchestrator.distributed` |", "| `orchestrator.data` |", 1)
  moved = moved.replace("| `orchestrator.engine`, ", "| `orchestrator.distributed`, `orchestrator.engine`, ", 1)
  assert moved != text and _layer_table(moved) != [tuple(names) for names in LAYERS]


#: The most of the package code one folder may hold: past it, a folder holds more than one concern.
MAX_FOLDER_SHARE = 0.15


def _oversized_folders(lines_by_module: dict[str, int], max_share: float = MAX_FOLDER_SHARE) -> dict[str, float]:
  """The folders (at the depth the layers name) holding more than ``max_share`` of the lines, with their share."""
  by_folder: dict[str, int] = {}
  for module, lines in lines_by_module.items():
    by_folder[_folder(module)] = by_folder.get(_folder(module), 0) + lines
  total = sum(by_folder.values())
  return {folder: round(lines / total, 3) for folder, lines in by_folder.items() if lines > max_share * total}


@pytest.mark.spec
def test_no_folder_holds_more_than_its_share_of_the_code():
  lines = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
  assert _oversized_folders(lines) == {}


@pytest.mark.spec
def test_the_share_check_catches_a_folder_past_its_share():
  """Negative control: 16 lines in 100 are over the share; 15 are not."""
  others = {f"orchestrator.f{i}.m": 12 for i in range(7)}  # 84 lines, 12 % each
  assert _oversized_folders({"orchestrator.app.a": 10, "orchestrator.app.b": 6, **others}) == {"orchestrator.app": 0.16}
  others = {f"orchestrator.f{i}.m": 17 for i in range(5)}  # 85 lines, 17 % each: over too
  assert _oversized_folders({"orchestrator.app.a": 15, **others}) == {f"orchestrator.f{i}": 0.17 for i in range(5)}
