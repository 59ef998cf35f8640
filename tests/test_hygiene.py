"""Cheap house-rule gates: notebooks, module size, layering, README tree. No GPU, seconds."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MODULES = sorted((ROOT / "qerl_lib").rglob("*.py"))

# ---------------------------------------------------------------------------------------------
# Notebooks


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ is empty"
    for nb in NOTEBOOKS:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", nb.name), f"{nb.name}: name notebooks NN_topic.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_clean_and_parametrised(path):
    raw = json.loads(path.read_text())  # valid JSON
    nb = nbformat.reads(json.dumps(raw), as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: exactly one cell must be tagged 'parameters' (found {len(tagged)})"
    params = ast.parse(tagged[0].source)
    names = {t.id for node in params.body if isinstance(node, ast.Assign) for t in node.targets
             if isinstance(t, ast.Name)}
    assert "device" in names, f"{path.name}: the parameters cell must define `device` (qerl reproduce sets it)"
    for node in params.body:  # literals only, so papermill overrides mean what they say
        assert isinstance(node, ast.Assign), f"{path.name}: parameters cell holds only assignments"
        ast.literal_eval(node.value)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert not cell.get("outputs"), f"{path.name} cell {i}: committed notebooks carry no outputs"
        assert cell.get("execution_count") is None, f"{path.name} cell {i}: clear execution counts"
        source = "\n".join(l for l in cell.source.splitlines() if not l.lstrip().startswith(("%", "!")))
        ast.parse(source, filename=f"{path.name}[{i}]")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_defines_no_functions(path):
    """Notebooks call the library; logic lives in qerl_lib (house rule P8)."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            tree = ast.parse("\n".join(l for l in cell.source.splitlines() if not l.lstrip().startswith(("%", "!"))))
            defs = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
            assert not defs, f"{path.name} cell {i} defines {defs}: move it into qerl_lib"


# ---------------------------------------------------------------------------------------------
# Modules: size and layering

# rank of each floor; a module may import only lower floors (utilities are floor 0).
UTILITIES = {"io", "errors", "paths", "envinfo", "__init__"}
STANDALONE = {"aqn", "data", "rewards", "verifier", "plots"}  # ground floor: only utilities below them
# modules split along one concept may import each other (engine -> engine_forward, rewards -> verifier)
CONCEPT_OF = {"verifier": "rewards"}
RANKS = {"nvfp4": 1, "formats": 2, "fp4_kernel": 2, "layers": 3, "embedded": 3, "checkpoint": 3.5, "loader": 4, "lora": 5,
         "models": 4, "engine": 6, "sampling": 5, "kv_cache": 6, "entropy": 7, "entropy_study": 9, "evaluation": 8,
         "grpo": 8, "bench": 8, "notebook_runner": 8, "cli": 10, "__main__": 11}


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _concept(name: str) -> str:
    return CONCEPT_OF.get(name, name.split("_")[0])


def _rank(name: str) -> int:
    if name in UTILITIES:
        return 0
    if name in STANDALONE:
        return 1
    for prefix, rank in sorted(RANKS.items(), key=lambda kv: -len(kv[0])):
        if name == prefix or name.startswith(prefix):
            return rank
    return 8  # new modules default to the trainer/evaluation floor


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size_and_layering(path):
    lines = path.read_text().count("\n")
    assert lines <= 600, f"{path.name} has {lines} lines: split it along a concept (house cap 600)"
    rel = path.relative_to(ROOT).with_suffix("")
    me = _floor(".".join(rel.parts))
    if path.name == "__init__.py" and len(rel.parts) == 2:
        return  # the package's lazy index
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qerl_lib"):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names if a.name.startswith("qerl_lib")}
    for mod in imported:
        other = _floor(mod)
        if other == me or mod == "qerl_lib" or _concept(other) == _concept(me):
            continue
        if me in UTILITIES and other in UTILITIES:
            continue  # the utility floor: io, errors, paths, envinfo
        if me in STANDALONE:
            assert _rank(other) == 0, f"{rel}: ground-floor module imports qerl_lib.{other}; it must stand alone"
        else:
            assert _rank(other) < _rank(me) or (me == "cli"), (
                f"{rel} (floor {_rank(me)}) imports qerl_lib.{other} (floor {_rank(other)}): only lower floors")


def test_nothing_imports_the_cli_or_notebooks():
    for path in MODULES:
        if "cli" in path.relative_to(ROOT).parts or path.name == "__main__.py":
            continue
        text = path.read_text()
        assert "qerl_lib.cli" not in text and "notebooks" not in re.findall(r"import\s+(\w+)", text), path


# ---------------------------------------------------------------------------------------------
# README


def test_readme_tree_lists_every_module_and_notebook():
    readme = (ROOT / "README.md").read_text()
    assert "make reproduce" in readme and "make test" in readme
    for path in MODULES:
        if path.name in ("__init__.py", "__main__.py"):
            continue
        assert path.name in readme, f"README's annotated tree does not mention {path.relative_to(ROOT)}"
    for nb in NOTEBOOKS:
        assert nb.name in readme, f"README does not describe {nb.name}"


def test_readme_figures_name_their_source_notebook():
    readme = (ROOT / "README.md").read_text()
    for m in re.finditer(r"figures/([\w.-]+\.png)", readme):
        line = readme[readme.rfind("\n", 0, m.start()) + 1: readme.find("\n", m.end())]
        assert re.search(r"\d\d_\w+\.ipynb|qerl \w+", line), f"README line for {m.group(0)} must name what makes it"
