"""Package layering: ``headwater`` is shared, ``workers`` and ``frontend`` are the two ends.

    headwater  ◀── workers
        ▲
        └───────── frontend  (which may also host workers in-process)

``workers`` must never import ``frontend`` (a worker process does not carry the HTTP
stack), and ``headwater`` imports neither. Checked two ways: statically, every import
statement in the source (at any depth: function bodies, ``TYPE_CHECKING`` blocks);
and at run time, importing every module of both packages in a fresh interpreter and
looking at ``sys.modules``. ``headwater.cli`` names its subcommands' modules as strings
and imports the chosen one on demand; that dispatch is not an import of the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: package → top-level packages its modules must not import
FORBIDDEN: dict[str, frozenset[str]] = {
    "workers": frozenset({"frontend"}),
    "headwater": frozenset({"frontend", "workers"}),
}


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in *source*.

    *module* is the dotted name of the file (``pkg.sub.mod``), used to resolve
    relative imports.
    """
    found: list[tuple[int, str]] = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def violations(package: str, root: Path = REPO) -> list[str]:
    """``path:line imports name`` for each forbidden import in *package*'s sources."""
    forbidden = FORBIDDEN[package]
    out: list[str] = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts)
        for line, name in imported_modules(path.read_text(), module):
            if name.split(".")[0] in forbidden:
                out.append(f"{rel}:{line} imports {name}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports_in_source(package: str) -> None:
    assert (REPO / package / "__init__.py").exists()
    assert violations(package) == []


def test_checker_catches_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "workers" / "runtime"
    pkg.mkdir(parents=True)
    (tmp_path / "workers" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(
        textwrap.dedent(
            """
            from __future__ import annotations
            from typing import TYPE_CHECKING
            import frontend.plane.tcp as tcp
            from headwater.wire import Role
            if TYPE_CHECKING:
                from frontend.router import Router

            def later():
                from frontend import cli
            """
        )
    )
    (pkg / "fine.py").write_text("from . import bad\nfrom ..engines import base\n")
    assert violations("workers", tmp_path) == [
        "workers/runtime/bad.py:4 imports frontend.plane.tcp",
        "workers/runtime/bad.py:7 imports frontend.router",
        "workers/runtime/bad.py:10 imports frontend",
    ]


def test_relative_imports_resolve_against_the_package() -> None:
    source = "from . import x\nfrom ..plane import connection\nfrom .base import y\n"
    assert [n for _, n in imported_modules(source, "headwater.etcd.client")] == [
        "headwater.etcd",
        "headwater.plane",
        "headwater.etcd.base",
    ]


_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    for top in ("headwater", "workers"):
        package = importlib.import_module(top)
        for info in pkgutil.walk_packages(package.__path__, top + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    print(" ".join(sorted(m for m in sys.modules if m == "frontend" or m.startswith("frontend."))))
    """
)


def test_importing_workers_and_headwater_loads_no_frontend_module() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], cwd=REPO, capture_output=True, text=True,
        timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
