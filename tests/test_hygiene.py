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

# The floors of qerl_lib, by subpackage (or top-level utility module). A module may import its own
# floor's package and any lower floor; packages that share a floor number may not import each other.
FLOORS = {
    "errors": 0, "io": 0, "paths": 0, "progress": 0,  # utilities
    "quant": 1, "tasks": 1, "plots": 1,            # ground floor
    "kernels": 2,
    "models": 3,
    "engine": 4,
    "train": 5, "evals": 5, "bench": 5,
    "studies": 6,
    "cli": 7, "__main__": 8,
}
UTILITY_FLOOR = 0


def floor_of(module: str) -> str:
    """'qerl_lib.engine.forward' -> 'engine'; 'qerl_lib.io' -> 'io'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def qerl_imports(source: str) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qerl_lib"):
            if node.module == "qerl_lib":  # `from qerl_lib import io` names modules, not the lazy index
                imported |= {f"qerl_lib.{a.name}" for a in node.names}
            else:
                imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported |= {a.name for a in node.names if a.name.startswith("qerl_lib")}
    return imported


def layering_violations(module: str, source: str) -> list[str]:
    """The rule broken by each import of `source` (module `module`, dotted) that reaches a higher or sibling floor."""
    me = floor_of(module)
    if me not in FLOORS:
        return [f"{module}: not in a known floor; add its package to FLOORS in tests/test_hygiene.py"]
    out = []
    for mod in sorted(qerl_imports(source)):
        other = floor_of(mod)
        if mod == "qerl_lib" or other == me:
            continue
        if other not in FLOORS:
            out.append(f"{module} imports {mod}, which is in no floor")
        elif FLOORS[me] == UTILITY_FLOOR and FLOORS[other] == UTILITY_FLOOR:
            continue  # the utilities may use each other
        elif FLOORS[other] >= FLOORS[me]:
            out.append(f"{module} (floor {FLOORS[me]}, {me}) imports {mod} (floor {FLOORS[other]}, {other}): "
                       f"a module may import only lower floors (see each subpackage's __init__ docstring)")
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_size_and_layering(path):
    lines = path.read_text().count("\n")
    assert lines <= 600, f"{path.name} has {lines} lines: split it along a concept (house cap 600)"
    rel = path.relative_to(ROOT).with_suffix("")
    if rel.parts == ("qerl_lib", "__init__"):
        return  # the package's lazy index names every floor by string
    assert not layering_violations(".".join(rel.parts), path.read_text()), layering_violations(".".join(rel.parts), path.read_text())


CUDA_SOURCES = sorted(p for ext in ("*.cu", "*.cuh") for p in (ROOT / "qerl_lib").rglob(ext))


@pytest.mark.parametrize("path", CUDA_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cuda_source_size(path):
    lines = path.read_text().count("\n")
    assert lines <= 600, f"{path.name} has {lines} lines: split it along a concept (house cap 600)"


def test_rollout_benchmarks_hash_every_engine_and_kernel_source():
    """`qerl bench rollout` pins the code that ran by hashing ``CODE_FILES``; a file missing from the list (or listed
    under a name that no longer exists, which the hashing skips) would leave a benchmark's engine unrecorded."""
    from qerl_lib.bench.rollout import CODE_FILES

    lib = ROOT / "qerl_lib"
    assert all((lib / name).is_file() for name in CODE_FILES), [n for n in CODE_FILES if not (lib / n).is_file()]
    sources = {str(p.relative_to(lib)) for sub in ("engine", "kernels") for p in (lib / sub).iterdir()
               if p.suffix in (".py", ".cu", ".cuh") and p.name != "__init__.py"}
    assert sources <= set(CODE_FILES), sorted(sources - set(CODE_FILES))


FIGURES = sorted((ROOT / "figures").glob("*.png"))


@pytest.mark.parametrize("path", FIGURES, ids=lambda p: p.name)
def test_figure_names_its_data_and_matches_the_results_file_it_was_drawn_from(path):
    """Every committed figure was written by ``plots/style.save_figure`` from a named source; one drawn from a file
    under results/ carries that file's current hash, so a results file updated without redrawing its figures fails
    here (the fix: ``make reproduce``, or the figure's own command in results/README.md)."""
    from PIL import Image

    from qerl_lib.io import tree_sha256

    text = Image.open(path).text
    assert "Source" in text and "Source-SHA256" in text, f"{path.name}: no Source metadata: redraw it with the kit"
    source = Path(text["Source"])
    source = source if source.is_absolute() else ROOT / source
    try:
        rel = source.resolve().relative_to(ROOT / "results")
    except ValueError:
        return  # drawn from a run of this machine (artifacts/): named, not checked
    current = ROOT / "results" / rel
    assert current.exists(), f"{path.name} was drawn from results/{rel}, which no longer exists"
    assert tree_sha256(current) == text["Source-SHA256"], \
        f"{path.name} is older than results/{rel}: run `make reproduce` (or the figure's command) and commit it"


def test_layering_check_catches_a_planted_upward_import():
    planted = "from qerl_lib.engine.rollout import RolloutEngine\n"
    problems = layering_violations("qerl_lib.models.loader", planted)
    assert len(problems) == 1 and "floor 3" in problems[0] and "only lower floors" in problems[0]
    sibling = "import qerl_lib.evals.entropy\n"
    assert layering_violations("qerl_lib.train.grpo", sibling), "same-floor packages must not import each other"
    assert layering_violations("qerl_lib.quant.nvfp4", "from qerl_lib import plots\n"), "ground floor stands alone"
    assert not layering_violations("qerl_lib.engine.forward", "from qerl_lib.kernels import pdl\n")
    assert not layering_violations("qerl_lib.io", "from qerl_lib.errors import UserError\n")


def test_top_level_holds_only_utilities():
    loose = sorted(p.name for p in (ROOT / "qerl_lib").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "errors.py", "io.py", "paths.py", "progress.py"], loose


def test_every_subpackage_states_its_floor():
    for init in sorted((ROOT / "qerl_lib").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert init.parent.name in FLOORS, f"{init.parent.name}: add it to FLOORS"
        assert f"Floor {FLOORS[init.parent.name]}" in doc, f"{init}: the docstring must say 'Floor N' and what it may import"


def test_library_carries_no_run_history():
    pattern = re.compile(r"\b(session [0-9]+|run [0-9]{1,2}\b|runs [0-9]{1,2}-[0-9]{1,2})")
    for path in MODULES:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.relative_to(ROOT)}:{i}: run history belongs in dev/LOG.md: {line.strip()}"


def test_nothing_imports_the_cli_or_notebooks():
    for path in MODULES:
        if "cli" in path.relative_to(ROOT).parts or path.name == "__main__.py":
            continue
        text = path.read_text()
        assert "qerl_lib.cli" not in text and "notebooks" not in re.findall(r"import\s+(\w+)", text), path


# ---------------------------------------------------------------------------------------------
# README


def readme_tree_paths(readme: str) -> set[str]:
    """Paths named by the README's annotated tree (the first fenced block after '## File tree'),
    resolved through indentation: 'qerl_lib/' then '  engine/' then '    rollout.py' -> qerl_lib/engine/rollout.py."""
    block = readme.split("## File tree", 1)[1].split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    paths = set()
    for line in block.splitlines():
        if not line.strip() or not line.lstrip()[0].isalnum() and not line.lstrip().startswith(("_", ".")):
            continue
        indent = len(line) - len(line.lstrip())
        name = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not (name.endswith("/") or "." in name):
            continue  # a continuation line of a description
        full = "".join(s for _, s in stack) + name
        paths.add(full.rstrip("/"))
        if name.endswith("/"):
            stack.append((indent, name))
    return paths


def test_readme_tree_lists_every_module_and_notebook():
    readme = (ROOT / "README.md").read_text()
    assert "make reproduce" in readme and "make test" in readme
    tree = readme_tree_paths(readme)
    for path in MODULES:
        if path.name == "__main__.py" or path.name == "__init__.py" and path.parent.name == "qerl_lib":
            continue
        rel = path.relative_to(ROOT)
        named = str(rel.parent) if path.name == "__init__.py" else str(rel)
        assert named in tree, f"README's annotated tree does not list {named}"
    for listed in tree:
        if listed.startswith("qerl_lib/") and listed.endswith(".py"):
            assert (ROOT / listed).exists(), f"README's tree lists {listed}, which does not exist"
    for nb in NOTEBOOKS:
        assert nb.name in readme, f"README does not describe {nb.name}"


def test_readme_lists_every_environment_switch():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Environment switches"):]
    table = table[:table.index("\n## ")]
    read = set()
    for path in MODULES:
        read |= set(re.findall(r"[\"'](QERL_[A-Z0-9_]+)[\"']", path.read_text()))
    assert read, "no QERL_ variable found: the pattern is stale"
    for name in sorted(read):
        assert f"| `{name}` |" in table, f"README's environment switches table does not list {name}"
    for name in re.findall(r"^\| `(QERL_[A-Z0-9_]+)` \|", table, flags=re.M):
        assert name in read, f"README lists {name}, which the library does not read"


def test_readme_figures_name_their_source_notebook():
    readme = (ROOT / "README.md").read_text()
    for m in re.finditer(r"figures/([\w.-]+\.png)", readme):
        line = readme[readme.rfind("\n", 0, m.start()) + 1: readme.find("\n", m.end())]
        assert re.search(r"\d\d_\w+\.ipynb|qerl \w+", line), f"README line for {m.group(0)} must name what makes it"


# ---------------------------------------------------------------------------------------------
# Triton kernels


def _jit_functions_with_string_defaults(source: str) -> list[str]:
    """Names of ``@triton.jit`` / ``@gluon.jit`` functions in ``source`` that give a parameter a string default."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        jit = any((d.func if isinstance(d, ast.Call) else d).__class__ is ast.Attribute
                  and (d.func if isinstance(d, ast.Call) else d).attr == "jit" for d in node.decorator_list)
        defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
        if jit and any(isinstance(d, ast.Constant) and isinstance(d.value, str) for d in defaults):
            found.append(node.name)
    return found


def test_no_jit_function_takes_a_string_default():
    """Triton 3.6 (the GPU image's) fails to compile a jit function that calls another without an argument whose
    default is a string ("'str' object has no attribute 'type'"); Triton 3.9 and the interpreter accept it, so no
    CPU test sees it (dev/LOG.md section 41, run 1). Callers pass such arguments."""
    planted = ("@triton.jit\ndef f(x, CACHE: tl.constexpr = ''):\n    pass\n"
               "@triton.jit\ndef g(x, B: tl.constexpr = True):\n    pass\n")
    assert _jit_functions_with_string_defaults(planted) == ["f"]
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in MODULES
           for name in _jit_functions_with_string_defaults(p.read_text())]
    assert not bad, f"give these parameters no string default and pass them at every call: {bad}"
