"""Environment variables are read in one module, typed and documented; only entry points
change the process (environment, GIL switch interval)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvserve
from kvserve import envs

PACKAGE = Path(kvserve.__file__).parent

# name -> (a good value, what it reads as, a bad value or None where any text is good)
CASES = {
    "KVSERVE_CACHE": ("/tmp/kv", Path("/tmp/kv"), None),
    "KVSERVE_CACHE_DIR": ("/tmp/old", Path("/tmp/old"), None),
    "XDG_CACHE_HOME": ("/tmp/xdg", Path("/tmp/xdg"), None),
    "CC": ("clang", "clang", None),
    "KVSERVE_DISABLE_KERNELS": ("1", True, "yes"),
    "KVSERVE_DISABLE_ONEDNN": ("1", True, "true"),
    "KVSERVE_DISABLE_PREPACK": ("0", False, "2"),
    "KVSERVE_DISABLE_AMX": ("1", True, "on"),
    "KVSERVE_DISABLE_AVX512_GEMM": ("1", True, "off"),
    "KVSERVE_UPCAST_MIN_ROWS": ("64", 64, "abc"),
    "KVSERVE_AVX512_BF16_DOT": ("0", False, "yes"),
    "KVSERVE_PREFILL_BF16_DOT": ("1", True, "maybe"),
    "KVSERVE_MALLOC_TUNING": ("0", False, "no"),
    "KVSERVE_CPU_OMP_THREADS_BIND": (" 0-3,8 ", "0-3,8", "0-x"),
    "KVSERVE_TENANT_SECRET": ("s" * 16, "s" * 16, "short"),
    "KVSERVE_BENCH_THREADS": ("3", 3, "0"),
    "KVSERVE_VLLM_PYTHON": ("/venv/bin/python", "/venv/bin/python", None),
    "KVSERVE_TEST_DEVICE": ("cuda", "cuda", None),
    "RANK": ("1", 1, "-1"),
    "WORLD_SIZE": ("2", 2, "0"),
    "LOCAL_RANK": ("0", 0, "x"),
    "LOCAL_WORLD_SIZE": ("2", 2, "0"),
    "MASTER_ADDR": (" 10.0.0.7 ", "10.0.0.7", None),
    "MASTER_PORT": ("29500", 29500, "0"),
    "KVSERVE_NODE_WAIT_S": ("30", 30, "0"),
}
# Unset: what the code read before the variable had a module of its own.
UNSET = {
    "KVSERVE_DISABLE_KERNELS": False, "KVSERVE_DISABLE_ONEDNN": False,
    "KVSERVE_DISABLE_PREPACK": False, "KVSERVE_DISABLE_AMX": False,
    "KVSERVE_DISABLE_AVX512_GEMM": False, "KVSERVE_UPCAST_MIN_ROWS": None,
    "KVSERVE_AVX512_BF16_DOT": None, "KVSERVE_PREFILL_BF16_DOT": None,
    "KVSERVE_MALLOC_TUNING": True, "KVSERVE_CPU_OMP_THREADS_BIND": "auto",
    "KVSERVE_TENANT_SECRET": None, "KVSERVE_TEST_DEVICE": "cpu", "MASTER_ADDR": "127.0.0.1",
    "KVSERVE_NODE_WAIT_S": 300,
}  # fmt: skip


def test_every_variable_is_tested_and_documented():
    assert set(CASES) == set(envs.VARIABLES)
    for name, var in envs.VARIABLES.items():
        assert var.doc.endswith(".") and len(var.doc) > 40, name
        assert "default" in var.doc or "unset" in var.doc, f"{name}: the doc names no default"


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_variable_parses_as_documented(monkeypatch, name):
    good, value, bad = CASES[name]
    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) == UNSET.get(name)
    monkeypatch.setenv(name, "")  # empty is unset
    assert getattr(envs, name) == UNSET.get(name)
    monkeypatch.setenv(name, good)
    assert getattr(envs, name) == value
    if bad is not None:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=rf"^{name}: ") as e:
            getattr(envs, name)
        # The value it refused, except a secret's (its length only).
        assert (repr(bad) in str(e.value)) != (name == "KVSERVE_TENANT_SECRET"), e.value


def test_a_bad_value_names_the_variable_and_the_value(monkeypatch):
    monkeypatch.setenv("KVSERVE_UPCAST_MIN_ROWS", "abc")
    with pytest.raises(ValueError, match="KVSERVE_UPCAST_MIN_ROWS: must be an integer >= 0, "
                                         "got 'abc'"):  # fmt: skip
        _ = envs.KVSERVE_UPCAST_MIN_ROWS
    with pytest.raises(AttributeError, match="KVSERVE_NOTHING"):
        _ = envs.KVSERVE_NOTHING


def _reads_environment(tree: ast.AST) -> list[int]:
    """Lines that touch ``os.environ`` / ``os.getenv`` (or ``environ`` / ``getenv`` imported
    from os)."""
    names = {"environ", "getenv", "putenv"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if names & {a.name for a in node.names}:
                lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment():
    """No module but envs reads the environment; entrypoint (the process set-up) touches
    only oneDNN's variables. Every KVSERVE_ name the package mentions is a documented
    variable, and so is every one its C kernels getenv."""
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        source = path.read_text()
        lines = _reads_environment(ast.parse(source))
        if rel == "entrypoint.py":
            assert lines and "KVSERVE_" not in source
        elif rel != "envs.py" and lines:
            offenders[rel] = lines
    assert not offenders, f"environment read outside kvserve/envs.py: {offenders}"
    documented = set(envs.VARIABLES) | set(envs.NATIVE_VARIABLES)
    mentioned = {m for p in PACKAGE.rglob("*.py") for m in re.findall(r"KVSERVE_[A-Z0-9_]+",
                                                                       p.read_text())}  # fmt: skip
    native = {m for p in PACKAGE.rglob("*.c")
              for m in re.findall(r'getenv\("(KVSERVE_[A-Z0-9_]+)"\)', p.read_text())}  # fmt: skip
    assert native == set(envs.NATIVE_VARIABLES)
    assert mentioned <= documented, mentioned - documented


PROBE = """
import os, sys, torch
before = (dict(os.environ), sys.getswitchinterval())
import kvserve.cli, kvserve.llm, kvserve.server.app, kvserve.engine, kvserve.model.linear_ops
from kvserve.model.linear_ops import select_ops
select_ops(torch.device("cpu"), torch.float32)  # what loading a model does
assert (dict(os.environ), sys.getswitchinterval()) == before, "a library changed the process"
from kvserve.entrypoint import setup_process
setup_process()
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"],
      sys.getswitchinterval())
setup_process(serve=True)
print(sys.getswitchinterval())
"""


def test_only_entry_points_change_the_process():
    """Importing the package and loading a model's ops leave the environment and the GIL
    switch interval alone (CPython's default: 5 ms); the entry-point set-up bounds oneDNN's
    caches, and for a server shortens the switch interval."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.split("\n")[:2]
    assert first.split() == ["64", "64", "0.005"]
    assert float(second) == 0.0005


def test_the_users_own_onednn_settings_win(monkeypatch):
    from kvserve.entrypoint import setup_process

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "300")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "")  # recorded, so that the test restores it
    monkeypatch.delenv("LRU_CACHE_CAPACITY")
    setup_process()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "300"
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"
