"""The library stays a library (issue 27): fanin never imports fanin_bench (the harnesses, the namespace testbed,
the simulator drivers) at module level, and importing fanin, or asking its command line for help, loads none of
the optional dependencies (grpc, torch, matplotlib, scipy).

Each check runs a fresh interpreter: this one has long imported everything the other tests use."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

FANIN = Path(__file__).resolve().parents[1] / "fanin"
OPTIONAL = ("grpc", "torch", "matplotlib", "scipy")


def _modules_after(code: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("module", ["fanin", "fanin.cli", "fanin.control", "fanin.controller", "fanin.kv"])
def test_importing_the_library_imports_no_fanin_bench(module):
    loaded = _modules_after(f"import {module}")
    assert module in loaded
    assert [m for m in loaded if m.split(".")[0] == "fanin_bench"] == []


def _top_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: not those inside functions (which run when called)
    but those in class bodies and in module-level if/try blocks."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            yield node.lineno, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, [node.module or ""] if node.level == 0 else []
        else:
            todo.extend(ast.iter_child_nodes(node))


def test_no_library_module_imports_fanin_bench_at_top_level():
    files = sorted(FANIN.rglob("*.py"))
    assert len(files) > 20, f"found only {len(files)} modules under {FANIN}"
    offenders = []
    for path in files:
        for line, names in _top_level_imports(ast.parse(path.read_text(), str(path))):
            offenders += [f"{path.relative_to(FANIN.parent)}:{line}: {n}" for n in names
                          if n.split(".")[0] == "fanin_bench"]
    assert offenders == []


@pytest.mark.parametrize("argv", [["-c", "import fanin"], ["-m", "fanin", "--help"],
                                  ["-m", "fanin", "switch", "--help"], ["-m", "fanin", "demo", "--help"]],
                         ids=["import fanin", "fanin --help", "fanin switch --help", "fanin demo --help"])
def test_optional_dependencies_load_only_when_used(argv):
    r = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # -X importtime writes "import time: self [us] | cumulative | imported package" to stderr, one line a module
    imported = [line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "fanin" in imported
    assert [m for m in imported if m.split(".")[0] in OPTIONAL] == []
