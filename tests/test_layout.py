"""The package layout: the public API stays importable, and every import inside `mmkv/` points down
the floors docs/structure.md names (cli -> selftest, bench -> engine -> request -> store -> images, hub ->
kv, testing -> errors), so no module imports one above it and no two rooms import each other."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mmkv"
FLOORS = {"cli": 0, "selftest": 1, "bench": 1, "engine": 2, "request": 3, "store": 4, "images": 5, "video": 5, "hub": 5,
          "kv": 6, "testing": 6, "errors": 7}


def _imports():
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(("mmkv",) + parts[: -1 if parts[-1] == "__init__" else None])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield module, node.module, path.name, node.lineno
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield module, alias.name, path.name, node.lineno


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "mmkv" and len(parts) > 1 else None


def test_every_module_has_a_floor():
    rooms = {_room(m) for m, *_ in _imports()} - {None}
    assert rooms <= set(FLOORS), f"modules outside the floors: {sorted(rooms - set(FLOORS))}"


def test_no_import_points_up():
    upward = [f"{module} ({name}:{line}) imports {target}"
              for module, target, name, line in _imports()
              if _room(module) in FLOORS and _room(target) in FLOORS
              and FLOORS[_room(target)] < FLOORS[_room(module)]]
    assert upward == []


def test_no_relative_imports_inside_mmkv():
    """Absolute imports only, so the floor check above sees every edge."""
    relative = [f"{p.name}:{n.lineno}" for p in ROOT.rglob("*.py")
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert relative == []


@pytest.mark.parametrize("name", ["Engine", "EngineSettings", "GenerationResult", "MMKVError",
                                  "InvalidRequestError", "UnknownImageError", "UnknownSkillError"])
def test_public_api(name):
    import mmkv
    assert getattr(mmkv, name) is not None
    assert name in mmkv.__all__


@pytest.mark.parametrize("module", ["mmkv.errors", "mmkv.engine", "mmkv.cli", "mmkv.request.scheduler",
                                    "mmkv.store.tiers", "mmkv.bench.command", "mmkv.testing.tiny",
                                    "mmkv.server.app", "mmkv.adapters", "mmkv.vqa_eval.cli", "mmkv.selftest"])
def test_modules_import(module):
    importlib.import_module(module)
