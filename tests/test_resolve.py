"""Model names and paths resolve to one HF directory from any working directory; bad input
names what was given and what is accepted; caches live where the environment says."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

import kvserve
from kvserve.cli import main
from kvserve.config import user_cache_dir
from kvserve.engine_args import add_engine_args, default_model, engine_kwargs
from kvserve.model import resolve
from kvserve.model.resolve import SMOLLM2_GGUF, bundled_model_dir, resolve_model

BUNDLED = Path(kvserve.__file__).parent / "bundled" / "kvserve-ref"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A stub ``kvserve.model.gguf`` whose prepare_gguf records its argument."""
    calls: list[Path] = []
    out = tmp_path / "prepared"

    def prepare_gguf(path: Path) -> Path:
        calls.append(path)
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text("{}")
        return out

    stub = types.ModuleType("kvserve.model.gguf")
    stub.prepare_gguf = prepare_gguf  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvserve.model.gguf", stub)
    return calls, out


def test_default_and_name_are_the_bundled_model_inside_the_package(tmp_path, monkeypatch):
    assert bundled_model_dir() == BUNDLED
    assert resolve_model(None) == resolve_model("kvserve-ref") == str(BUNDLED)
    assert (BUNDLED / "config.json").is_file() and (BUNDLED / "README.md").is_file()
    # The same from another directory, even one holding a directory of that name.
    (tmp_path / "kvserve-ref").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("kvserve-ref") == default_model() == str(BUNDLED)
    with pytest.raises(FileNotFoundError, match="without config.json"):
        resolve_model("./kvserve-ref")  # a path is a path


def test_missing_bundled_model_is_an_error_not_a_random_model(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve, "bundled_model_dir", lambda: tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="missing from this installation"):
        default_model()


def test_hf_directory_is_itself(checkpoint, tmp_path, monkeypatch):
    ckpt = checkpoint("llama_gqa")
    assert resolve_model(ckpt) == str(Path(ckpt).resolve())
    monkeypatch.chdir(Path(ckpt).parent)
    assert resolve_model(Path(ckpt).name) == str(Path(ckpt).resolve())


def test_gguf_file_and_directory_go_through_prepare_gguf(tmp_path, prepared):
    calls, out = prepared
    f = tmp_path / "m" / "tiny.Q4_0.gguf"
    f.parent.mkdir()
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == str(out)
    assert resolve_model(str(f.parent)) == str(out)  # a directory with one .gguf, no config
    assert calls == [f.resolve(), f.resolve()]
    (f.parent / "config.json").write_text("{}")
    assert resolve_model(str(f.parent)) == str(f.parent.resolve())  # config.json wins
    assert len(calls) == 2


def test_directory_with_two_ggufs_asks_for_one(tmp_path, prepared):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        resolve_model(str(tmp_path))
    assert prepared[0] == []


@pytest.mark.parametrize(
    "given, why",
    [
        ("no-such-model", "neither a known model name nor an existing path"),
        ("empty-dir", "a directory without config.json or a .gguf file"),
        ("weights.bin", "a file that is not a .gguf file"),
    ],
)
def test_bad_input_names_it_and_the_accepted_forms(tmp_path, monkeypatch, given, why):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(given)
    msg = str(err.value)
    assert repr(given) in msg and why in msg
    assert "kvserve-ref, smollm2" in msg and ".gguf file" in msg and "config.json" in msg


def test_smollm2_needs_the_download_then_resolves(cache, prepared):
    calls, out = prepared
    with pytest.raises(FileNotFoundError, match="`kvserve download smollm2`"):
        resolve_model("smollm2")
    gguf = cache / "models" / "smollm2" / SMOLLM2_GGUF
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    assert resolve_model("smollm2") == str(out)
    assert calls == [gguf.resolve()]
    (gguf.parent / "config.json").write_text("{}")  # a converter that writes beside the file
    assert resolve_model("smollm2") == str(gguf.parent)


def test_cli_model_flag_resolves_names_and_refuses_bad_input(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert "kvserve-ref, smollm2" in p.format_help()
    assert engine_kwargs(p.parse_args(["--model", "kvserve-ref"]))["model"] == str(BUNDLED)
    assert engine_kwargs(p.parse_args([]))["model"] == str(BUNDLED)
    missing = str(tmp_path / "nope")
    assert main(["generate", "--model", missing, "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "kvserve generate: error:" in err and missing in err and "Traceback" not in err


def test_plan_takes_a_name(capsys):
    assert main(["plan", "kvserve-ref", "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["model"] == str(BUNDLED)


def test_user_cache_dir_precedence(tmp_path, monkeypatch):
    for var in ("KVSERVE_CACHE", "KVSERVE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "kvserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "kvserve"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "old"))
    assert user_cache_dir() == tmp_path / "old"
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "new"))
    assert user_cache_dir() == tmp_path / "new"
