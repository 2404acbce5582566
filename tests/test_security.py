"""Package-wide security scan (issue 6, "Security"): nothing in ``src/vapo_async`` can turn network or
file input into code.

An AST walk over every module of the package (not only transport/controller, which
``tests/transport/test_no_unsafe_deserialisation.py`` covers already) refuses:
- imports of pickle-family modules (pickle, dill, cloudpickle, marshal, shelve, joblib, ...);
- calls of eval / exec / compile / __import__, ``pickle.loads``-style calls, zmq's ``recv_pyobj`` /
  ``recv_serialized``, torch.distributed's ``*_object_list`` / ``*_object`` collectives (they pickle);
- ``torch.load`` (or Lightning's ``fit/validate/test/predict(ckpt_path=...)``, which calls it)
  without a literal ``weights_only=True``; ``np.load(..., allow_pickle=True)``; ``yaml.load`` /
  ``yaml.unsafe_load``; ``trust_remote_code=True``; ``subprocess`` with ``shell=True``;
- the string ``VLLM_ALLOW_INSECURE_SERIALIZATION`` anywhere in the package, tests, benchmarks or
  tools (vLLM must be driven without it), and ``collective_rpc`` with anything but a string literal
  method name (a callable would be pickled to the workers).

Deliberate, reviewed exception: ``hydra.utils.instantiate`` in ``rewards/reward.py`` builds the
user's own ``reward.custom`` ``_target_`` from the command line / config file the user wrote (the
operator's configuration, not received data). Any other ``instantiate`` call fails the scan.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "vapo_async"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)

BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib",
                  "pickletools", "copyreg"}
BANNED_NAMES = {"eval", "exec", "compile", "__import__", "execfile"}
BANNED_ATTRS = {"loads", "recv_pyobj", "recv_serialized", "unsafe_load", "full_load",
                "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                "send_object_list", "recv_object_list"}
"""Attribute calls that unpickle whatever the owner is (``pickle.loads``, ``zmq.recv_pyobj``, torch.distributed)."""
SAFE_LOADS_OWNERS = {"json", "msgpack", "tomllib", "orjson"}
"""``X.loads`` is fine for these parsers of plain data."""
CKPT_METHODS = {"fit", "validate", "test", "predict"}
INSTANTIATE_ALLOWED = {"rewards/reward.py"}
INSECURE_SWITCH = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _owner(func: ast.Attribute) -> str:
    """Dotted owner of an attribute call: ``torch.load`` -> 'torch', ``a.b.c()`` -> 'a.b'."""
    parts = []
    node: ast.expr = func.value
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _call_problems(call: ast.Call, rel: str, imported_names: set[str]) -> Iterator[str]:
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    owner = _owner(f) if isinstance(f, ast.Attribute) else ""
    if isinstance(f, ast.Name) and f.id in BANNED_NAMES:
        yield f"calls {f.id}()"
    if isinstance(f, ast.Attribute) and name in BANNED_ATTRS and not (
            name == "loads" and owner.split(".")[-1] in SAFE_LOADS_OWNERS):
        yield f"calls {owner}.{name}() (unpickles or runs code)"
    if name == "load" and (owner.endswith("torch") or (isinstance(f, ast.Name) and "torch.load" in imported_names)):
        if not _is_true(_kw(call, "weights_only")):
            yield "calls torch.load without weights_only=True"
    if name == "load" and owner.split(".")[-1] == "yaml":
        yield "calls yaml.load (use yaml.safe_load)"
    if name == "load" and owner.split(".")[-1] in {"np", "numpy"} and _is_true(_kw(call, "allow_pickle")):
        yield "calls np.load(allow_pickle=True)"
    if name in CKPT_METHODS and _kw(call, "ckpt_path") is not None and not _is_true(_kw(call, "weights_only")):
        yield f"calls .{name}(ckpt_path=...) without weights_only=True (Lightning would torch.load with pickle)"
    if _is_true(_kw(call, "trust_remote_code")):
        yield "passes trust_remote_code=True"
    if _is_true(_kw(call, "shell")):
        yield "runs a subprocess with shell=True"
    if name == "instantiate" and rel not in INSTANTIATE_ALLOWED:
        yield "calls hydra instantiate outside the reviewed reward.custom hook"
    if name == "collective_rpc" and not (call.args and isinstance(call.args[0], ast.Constant)
                                         and isinstance(call.args[0].value, str)):
        yield "calls collective_rpc with a non-literal method (callables are pickled to the workers)"


def problems(path: Path) -> list[str]:
    """Every violation in one module, as 'file:line: what'."""
    rel = _rel(path) if path.is_relative_to(PACKAGE) else path.name
    tree = ast.parse(path.read_text(), filename=str(path))
    imported: set[str] = set()
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in BANNED_MODULES:
                    out.append(f"{rel}:{node.lineno}: imports {a.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if mod.split(".")[0] in BANNED_MODULES:
                out.append(f"{rel}:{node.lineno}: imports from {mod}")
            imported.update(f"{mod}.{a.name}" for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            out.extend(f"{rel}:{node.lineno}: {p}" for p in _call_problems(node, rel, imported))
    return out


@pytest.mark.parametrize("path", MODULES, ids=[_rel(p) for p in MODULES])
def test_module_turns_no_input_into_code(path: Path) -> None:
    assert problems(path) == []


def test_no_insecure_vllm_serialisation_switch_anywhere() -> None:
    needle = INSECURE_SWITCH
    hits = []
    for folder in ("src", "tests", "benchmarks", "tools", "conf"):
        for p in (ROOT / folder).rglob("*"):
            if p.is_file() and p.suffix in {".py", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".cfg", ".md"}:
                if p == Path(__file__):
                    continue
                if needle in p.read_text(errors="replace"):
                    hits.append(str(p.relative_to(ROOT)))
    for p in (ROOT / "Makefile", ROOT / "pyproject.toml"):
        if p.is_file() and needle in p.read_text():
            hits.append(p.name)
    assert hits == [], f"{needle} must never be set; found in {hits}"


def test_scan_covers_every_package(tmp_path: Path) -> None:
    """The scan walks all sub-packages, and it does catch each banned pattern (so it can fail)."""
    packages = {p.parent.name for p in MODULES}
    assert {"transport", "controller", "generator", "learner", "eval", "data", "rewards", "algo"} <= packages
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom dill import loads\nimport torch, numpy as np, yaml, subprocess\n"
        "eval('1')\nexec('x=1')\ntorch.load('f')\ntorch.load('f', weights_only=False)\n"
        "pickle.loads(b'')\nsock.recv_pyobj()\nnp.load('x', allow_pickle=True)\nyaml.load('a')\n"
        "trainer.fit(m, ckpt_path='c')\nAutoModel.from_pretrained('d', trust_remote_code=True)\n"
        "subprocess.run('ls', shell=True)\ninstantiate(cfg)\nllm.collective_rpc(fn)\n"
        "dist.broadcast_object_list([x])\n"
        "json.loads('1')\nmsgpack.loads(b'')\ntorch.load('f', weights_only=True)\nnp.load('x')\n"
        "trainer.fit(m, ckpt_path='c', weights_only=True)\nllm.collective_rpc('reload_weights')\n"
    )
    found = problems(bad)
    lines = sorted({int(p.split(":")[1]) for p in found})
    # lines 1-17 hold one banned pattern each (line 3 is a plain import); lines 18-23 are the safe forms
    assert lines == [1, 2, *range(4, 18)], found
