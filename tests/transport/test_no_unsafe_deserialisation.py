"""No pickle / eval / exec (or anything that unpickles) on the network and file-input paths of
the transport and controller packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "vapo_async"
MODULES = sorted([*(SRC / "transport").glob("*.py"), *(SRC / "controller").glob("*.py")])
BANNED_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
# calls that unpickle by default or on request
BANNED_ATTRS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("pickle", "loads"), ("recv_pyobj",), ("recv_serialized",)}


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_module_has_no_unsafe_deserialisation(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & BANNED_MODULES, f"{path.name}:{node.lineno}"
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in BANNED_MODULES, f"{path.name}:{node.lineno}"
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                assert f.id not in BANNED_CALLS, f"{path.name}:{node.lineno} calls {f.id}"
            elif isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else ""
                assert (owner, f.attr) not in BANNED_ATTRS and (f.attr,) not in BANNED_ATTRS, \
                    f"{path.name}:{node.lineno} calls {owner}.{f.attr}"


def test_the_scan_sees_every_module() -> None:
    names = {p.name for p in MODULES}
    assert {"messages.py", "rollout.py", "client.py", "weights.py", "fetch.py", "server.py", "state.py"} <= names
