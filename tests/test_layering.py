"""Package layering: a core both sides share, the two sides, and a top that joins them.

    top     headwater.cli, headwater.cluster,       may import everything
            headwater.testing
              │                │
              ▼                ▼
    frontend ──(engine registry, runtime)──▶ workers
              │                                │
              ▼                                ▼
    core    headwater.*  (wire, plane, etcd, instrumentation, ...): imports neither side

* the core imports neither ``frontend`` nor ``workers`` nor the top;
* ``workers`` never imports ``frontend`` (a worker process does not carry the HTTP
  stack) nor the top;
* ``frontend`` never imports the top, and reaches workers only through the engine
  registry, the engine interface and the runtime (its in-process cluster): never an
  engine's own package, so an engine is added in one place.

Checked two ways. Statically: every import statement in the source, at any depth
(function bodies, ``TYPE_CHECKING`` blocks), and every string that names one of the
project's modules (``importlib.import_module("frontend.x")``, a subcommand table, an
engine spec's ``"module:attribute"``): an import through a string is still an import.
At run time: importing every module of a layer in a fresh interpreter loads nothing
it may not import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("headwater", "workers", "frontend")
TOP = ("headwater.cli", "headwater.cluster", "headwater.testing", "headwater.__main__")
#: What frontend may import from workers: the registry, the interface (its config part
#: included), the runtime.
FRONTEND_MAY_USE = (
    "workers.engines.registry",
    "workers.engines.base",
    "workers.engines.config",
    "workers.runtime",
)

_MODULE_STRING = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+(:[A-Za-z_]\w*)?")


def layer(module: str) -> str:
    """``top``, ``core``, ``workers`` or ``frontend``; ``other`` for anything else."""
    if _within(module, TOP):
        return "top"
    top_level = module.split(".")[0]
    if top_level == "headwater":
        return "core"
    return top_level if top_level in ("workers", "frontend") else "other"


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def forbidden(importer: str, imported: str) -> bool:
    """Whether module *importer* may not import module *imported*."""
    src, dst = layer(importer), layer(imported)
    if src in ("top", "other") or dst == "other" or src == dst:
        return False
    if src == "core":
        return True  # core imports only core (same layer) and third parties
    if dst == "top":
        return True
    if src == "frontend" and dst == "workers":
        # Allowed modules, and the packages that hold them (importing one loads those).
        parents = any(allowed.startswith(imported + ".") for allowed in FRONTEND_MAY_USE)
        return not (parents or _within(imported, FRONTEND_MAY_USE))
    return src == "workers" and dst == "frontend"


def project_modules(root: Path = REPO) -> set[str]:
    names: set[str] = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_modules(
    source: str, module: str, known: set[str] | frozenset[str] = frozenset()
) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in *source*, and of every
    string that is exactly the name of a module in *known* (optionally ``:attribute``).

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
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.partition(":")[0]
            if name in known and _MODULE_STRING.fullmatch(node.value):
                found.append((node.lineno, name))
    return sorted(found)


def violations(root: Path = REPO) -> list[str]:
    """``path:line imports name`` for each forbidden import under *root*'s packages."""
    known = project_modules(root)
    out: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            parts = rel.with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for line, name in imported_modules(path.read_text(), module, known):
                if forbidden(module, name):
                    out.append(f"{rel}:{line} imports {name}")
    return out


@pytest.mark.slow
def test_no_forbidden_imports_in_source() -> None:
    for package in PACKAGES:
        assert (REPO / package / "__init__.py").exists()
    assert violations() == []


def test_the_rules() -> None:
    assert forbidden("headwater.plane.server", "workers.runtime")
    assert forbidden("headwater.wire.codec", "frontend.pipeline")
    assert forbidden("headwater.plane.kv", "headwater.cli")  # core below the top too
    assert not forbidden("headwater.cli.serve", "frontend.server")
    assert not forbidden("headwater.cluster.recipes", "workers.lifecycle")
    assert forbidden("workers.lifecycle", "frontend.config")
    assert forbidden("workers.lifecycle", "headwater.cli.options")
    assert forbidden("frontend.discovery.local", "workers.engines.mocker")
    assert forbidden("frontend.discovery.local", "workers.lifecycle")
    assert forbidden("frontend.server", "headwater.cluster.children")
    assert not forbidden("frontend.discovery.local", "workers.engines.registry")
    assert not forbidden("frontend.discovery.local", "workers.runtime.kv_transfer")
    assert not forbidden("workers.engines.registry", "workers.engines.mocker.engine")


def test_checker_catches_every_kind_of_import(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "frontend" / "plane.py").write_text("")
    (tmp_path / "frontend" / "router.py").write_text("")
    (tmp_path / "workers" / "engines").mkdir()
    (tmp_path / "workers" / "engines" / "__init__.py").write_text("")
    (tmp_path / "workers" / "engines" / "mocker.py").write_text("")
    (tmp_path / "workers" / "engines" / "registry.py").write_text(
        'SPEC = "workers.engines.mocker:build"\n'  # workers naming workers: fine
    )
    pkg = tmp_path / "workers" / "runtime"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(
        textwrap.dedent(
            """
            from __future__ import annotations
            import importlib
            from typing import TYPE_CHECKING
            import frontend.plane as plane
            from headwater.wire import Role
            if TYPE_CHECKING:
                from frontend.router import Router

            def later():
                from frontend import router
                return importlib.import_module("frontend.router")
            """
        )
    )
    (pkg / "fine.py").write_text("from . import bad\nfrom ..engines import registry\n")
    (tmp_path / "headwater" / "cli.py").write_text(
        'SUBCOMMANDS = {"serve": ("frontend.router", "help")}\n'  # the top: fine
    )
    (tmp_path / "headwater" / "core.py").write_text(
        'TABLE = {"x": ("workers.engines.mocker", "not here")}\n'
    )
    (tmp_path / "frontend" / "local.py").write_text(
        "from workers.engines import registry\nfrom workers.engines.mocker import build\n"
    )
    assert violations(tmp_path) == [
        "headwater/core.py:1 imports workers.engines.mocker",
        "workers/runtime/bad.py:5 imports frontend.plane",
        "workers/runtime/bad.py:8 imports frontend.router",
        "workers/runtime/bad.py:11 imports frontend",
        "workers/runtime/bad.py:12 imports frontend.router",
        "frontend/local.py:2 imports workers.engines.mocker",
    ]


def test_relative_imports_resolve_against_the_package() -> None:
    source = "from . import x\nfrom ..plane import connection\nfrom .base import y\n"
    assert [n for _, n in imported_modules(source, "headwater.etcd.client")] == [
        "headwater.etcd",
        "headwater.plane",
        "headwater.etcd.base",
    ]


_IMPORT_LAYER = textwrap.dedent(
    """
    import importlib, pathlib, sys
    package, top = sys.argv[1], tuple(sys.argv[2:])
    for path in sorted(pathlib.Path(package).rglob("*.py")):
        parts = path.with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not name.endswith("__main__") and not any(
            name == t or name.startswith(t + ".") for t in top
        ):
            importlib.import_module(name)
    print(" ".join(sorted(sys.modules)))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("wanted", ["core", "workers", "frontend"])
def test_importing_a_layer_loads_nothing_it_may_not_import(wanted: str) -> None:
    package = {"core": "headwater", "workers": "workers", "frontend": "frontend"}[wanted]
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_LAYER, package, *TOP],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.split()
    assert any(layer(m) == wanted for m in loaded)
    # What the layer's modules pulled in at import time (the registry loads no engine).
    assert [m for m in loaded if forbidden(f"{package}.any_module", m)] == []
