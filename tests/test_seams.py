"""The two seams, checked on the source (ast): outside ``replaybuf/storage/`` a module imports
from the storage package only the names its ``__init__`` exports, never a private storage
module; the readers (sampling, analysis, the viewer) use a buffer only through ``BufferView``,
never a private attribute of it."""

import ast
from pathlib import Path

import pytest

import replaybuf
import replaybuf.storage

PACKAGE = Path(replaybuf.__file__).parent
STORAGE = "replaybuf.storage"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def storage_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports in ``source`` (module ``module``) of a private storage module, or of a name the
    storage package does not export."""
    exported = set(replaybuf.storage.__all__)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node)
            targets = [(target, alias.name) for alias in node.names]
        else:
            continue
        for target, name in targets:
            if target != STORAGE and not target.startswith(STORAGE + "."):
                continue
            if name is not None and name.startswith("_"):  # from replaybuf.storage import _zarr
                target, name = f"{target}.{name}", None
            inner = target[len(STORAGE) :].lstrip(".").split(".")
            if any(part.startswith("_") for part in inner):
                found.append(f"line {node.lineno}: imports private module {target}")
            elif name is not None and name not in exported:
                found.append(f"line {node.lineno}: imports {name!r} from {target}, not in {STORAGE}.__all__")
    return found


def test_no_module_outside_storage_imports_a_storage_internal():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "storage") in path.parents:
            continue
        module = _module_name(path)
        for problem in storage_violations(path.read_text(), module, path.name == "__init__.py"):
            problems.append(f"{path.relative_to(PACKAGE.parent)} {problem}")
    assert not problems, "storage internals imported outside replaybuf/storage/:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "source, module, problem",
    [
        ("from .storage._cache import with_cache", "replaybuf.buffer", "private module replaybuf.storage._cache"),
        (
            "from ..storage._chunks import chunk_cache",
            "replaybuf.sampling.x",
            "private module replaybuf.storage._chunks",
        ),
        ("def f():\n    from .storage._zarr import z", "replaybuf.actors", "private module replaybuf.storage._zarr"),
        ("import replaybuf.storage._owned", "replaybuf.x", "private module replaybuf.storage._owned"),
        (
            "from .storage.base import check_layout",
            "replaybuf.maintenance",
            "'check_layout' from replaybuf.storage.base",
        ),
        ("from . import _kv", "replaybuf.storage", "private module replaybuf.storage._kv"),
    ],
)
def test_the_check_finds_each_kind_of_storage_internal(source, module, problem):
    is_package = module == "replaybuf.storage"
    (found,) = storage_violations(source, module, is_package)
    assert problem in found


def test_the_check_allows_exported_names():
    source = "from .storage import Storage, chunk_cache\nfrom .storage.base import make_storage\nimport numpy"
    assert storage_violations(source, "replaybuf.buffer") == []


def test_every_exported_name_resolves():
    for name in replaybuf.storage.__all__:
        assert getattr(replaybuf.storage, name) is not None, name


READERS = ["sampling", "analysis.py", "viewer"]


def private_buffer_attributes(source: str) -> list[str]:
    """``buffer._x``-style reads in ``source``: a private attribute of a buffer (an expression
    ending in ``buffer`` or ``source``), which a reader must not use."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner.endswith(("buffer", "source")):
                found.append(f"line {node.lineno}: {owner}.{node.attr}")
    return found


def test_readers_use_only_the_buffer_view():
    problems = []
    for reader in READERS:
        paths = [PACKAGE / reader] if reader.endswith(".py") else sorted((PACKAGE / reader).rglob("*.py"))
        for path in paths:
            problems += [f"{path.relative_to(PACKAGE.parent)} {p}" for p in private_buffer_attributes(path.read_text())]
    assert not problems, "private buffer attributes read outside the buffer:\n" + "\n".join(problems)


def test_the_reader_check_finds_private_buffer_attributes():
    source = 'lens = buffer._meta["episode_lens"]\nself.replay_buffer._check_writable("x")\nok = self._lens'
    assert private_buffer_attributes(source) == ["line 1: buffer._meta", "line 2: self.replay_buffer._check_writable"]
