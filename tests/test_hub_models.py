"""Models by Hugging Face hub id, from a hub cache the test lays out as ``huggingface_hub``
writes it (``models--Org--Name/refs/<ref>``, ``snapshots/<commit>/<file>`` symlinks into
``blobs/``), with no network: ``huggingface_hub.scan_cache_dir`` checks the layout is theirs,
the resolver must find the snapshot the test wrote for each revision, ``kvserve serve --model
ID`` must answer as the same checkpoint loaded from its directory does, and a missing id
offline must fail at once, naming the id, the cache and ``HF_HUB_OFFLINE``, without a single
connection (a listener standing in for the hub and its proxy counts them).

``huggingface_hub`` reads ``HF_HOME``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` when it is
imported, so each environment is tried in a fresh interpreter, as a user's process starts."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.model import resolve
from kvserve.model.hub import HubId, download_patterns, parse_hub_id
from kvserve.model.resolve import resolve_model
from tests.serve_process import ServeProcess

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
MISSING_ID = "HuggingFaceTB/NotInTheCache"
REPO = Path(__file__).resolve().parent.parent
HF_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "HF_ENDPOINT", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")  # fmt: skip
START_TIMEOUT = 120.0


def commit_of(ref: str) -> str:
    return hashlib.sha1(f"commit {ref}".encode()).hexdigest()


def blob_name(path: Path, data: bytes) -> str:
    """The hub's blob name: an LFS file's sha256, a git file's blob sha1."""
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out(cache: Path, repo_id: str, refs: dict[str, Path]) -> dict[str, Path]:
    """Write ``repo_id`` into the hub cache ``cache``: per ref, the files of a checkpoint
    directory as one commit's snapshot. Returns ref -> its snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    out = {}
    for ref, src in refs.items():
        commit = commit_of(ref)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in sorted(src.iterdir()):
            data = f.read_bytes()
            blob = repo / "blobs" / blob_name(f, data)
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        out[ref] = snap
    return out


@pytest.fixture
def hub_cache(tmp_path, checkpoint):
    """HF_HOME at tmp_path/hf holding HUB_ID: main is llama_gqa, v2 is llama_mha."""
    main, v2 = Path(checkpoint("llama_gqa")), Path(checkpoint("llama_mha"))
    snaps = lay_out(tmp_path / "hf" / "hub", HUB_ID, {"main": main, "v2": v2})
    return tmp_path / "hf", snaps, {"main": main, "v2": v2}


class Listener:
    """A TCP port that counts connections and closes them: the hub's endpoint and the
    proxy every request would go through, so any attempt to reach the network is seen."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def listener():
    net = Listener()
    yield net
    net.close()


def hf_env(listener: Listener, offline: bool = True, **hf: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HF_VARIABLES}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", HF_ENDPOINT=listener.url,
               HTTP_PROXY=listener.url, HTTPS_PROXY=listener.url, NO_PROXY="", **hf)  # fmt: skip
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


RESOLVE = """
import json, sys
from kvserve.model.resolve import resolve_model
out = []
for spec in json.loads(sys.argv[1]):
    try:
        out.append(["ok", resolve_model(*spec)])
    except Exception as e:
        out.append([type(e).__name__, str(e)])
print(json.dumps(out))
"""


def resolve_in(env: dict[str, str], *specs: tuple[str, str | None]) -> list[list[str]]:
    """resolve_model(name, revision) for each spec in a fresh interpreter under ``env``."""
    proc = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(specs)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_laid_out_cache_is_huggingface_hubs(hub_cache):
    from huggingface_hub import scan_cache_dir

    home, snaps, _ = hub_cache
    info = scan_cache_dir(home / "hub")
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == HUB_ID and repo.repo_type == "model"
    got = {rev.commit_hash: (set(rev.refs), rev.snapshot_path) for rev in repo.revisions}
    assert got == {commit_of("main"): ({"main"}, snaps["main"]),
                   commit_of("v2"): ({"v2"}, snaps["v2"])}  # fmt: skip


def test_offline_resolution_finds_each_revision_in_hf_home(hub_cache, listener):
    home, snaps, _ = hub_cache
    env = hf_env(listener, HF_HOME=str(home))
    got = resolve_in(
        env,
        (HUB_ID, None),
        (f"{HUB_ID}@v2", None),
        (HUB_ID, "v2"),
        (f"{HUB_ID}@{commit_of('v2')}", None),
        (f"{HUB_ID}@main", "main"),
    )
    assert got == [["ok", str(snaps[r])] for r in ("main", "v2", "v2", "v2", "main")]
    assert listener.connections == 0


def test_hf_hub_cache_wins_over_hf_home(hub_cache, listener, tmp_path):
    home, snaps, _ = hub_cache
    env = hf_env(listener, HF_HOME=str(tmp_path / "elsewhere"), HF_HUB_CACHE=str(home / "hub"))
    assert resolve_in(env, (HUB_ID, None)) == [["ok", str(snaps["main"])]]
    env = hf_env(listener, HF_HOME=str(tmp_path / "elsewhere"))
    [[kind, msg]] = resolve_in(env, (HUB_ID, None))
    assert kind == "FileNotFoundError" and str(tmp_path / "elsewhere" / "hub") in msg
    assert listener.connections == 0


def test_missing_id_offline_fails_fast_naming_id_cache_and_variable(hub_cache, listener):
    home, _, _ = hub_cache
    t0 = time.monotonic()
    got = resolve_in(hf_env(listener, HF_HOME=str(home)), (MISSING_ID, None), (HUB_ID, "v3"))
    elapsed = time.monotonic() - t0
    for (kind, msg), rev in zip(got, ("main", "v3"), strict=True):
        assert kind == "FileNotFoundError", msg
        assert repr(MISSING_ID if rev == "main" else HUB_ID) in msg and f"revision {rev}" in msg
        assert str(home / "hub") in msg and "HF_HUB_OFFLINE" in msg
    assert listener.connections == 0
    assert elapsed < 60  # an interpreter's start and two cache look-ups; no network wait


def test_online_the_hub_is_asked_and_an_unreachable_hub_falls_back_to_the_cache(
    hub_cache, listener
):
    """The contrast to the offline tests: online, the resolver does go to the endpoint (the
    listener sees it), then serves a cached model and names the cache for a missing one."""
    home, snaps, _ = hub_cache
    env = hf_env(listener, offline=False, HF_HOME=str(home))
    got = resolve_in(env, (HUB_ID, None), (MISSING_ID, None))
    assert got[0] == ["ok", str(snaps["main"])]
    assert got[1][0] == "FileNotFoundError" and "cannot be reached" in got[1][1]
    assert str(home / "hub") in got[1][1] and repr(MISSING_ID) in got[1][1]
    assert listener.connections >= 2


def test_serve_by_hub_id_offline_answers_as_the_local_directory(hub_cache, listener, make_llm):
    home, _, src = hub_cache
    args = ["--model", HUB_ID, "--max-model-len", "256", "--dtype", "float32",
            "--disable-access-log"]  # fmt: skip
    with ServeProcess(args, hf_env(listener, HF_HOME=str(home)), START_TIMEOUT) as srv:
        url = srv.url
        # The engine's start-up block, as LLM logs it (tests/test_startup_log.py checks it).
        assert re.search(r"KV pool: +[\d.]+ GiB .* blocks x 16 tokens", srv.text), srv.text
        models = httpx.get(url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [HUB_ID]  # vLLM's default served name
        body = {"model": HUB_ID, "prompt": "hello there", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["text"]
        assert srv.stop() == 0
    ref = make_llm(str(src["main"]), max_model_len=256, dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert served == ref.generate(["hello there"], sp)[0].outputs[0].text
    assert listener.connections == 0


def test_serve_a_missing_id_offline_is_a_clear_error(hub_cache, listener):
    home, _, _ = hub_cache
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", MISSING_ID, "--port", "0"]
    proc = subprocess.run(cmd, env=hf_env(listener, HF_HOME=str(home)), capture_output=True,
                          text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "kvserve serve: error: model:" in proc.stderr and "Traceback" not in proc.stderr
    assert MISSING_ID in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    assert listener.connections == 0


# -- in this process: what the resolver does with a snapshot, and what it asks to download --


@pytest.fixture
def hub_here(hub_cache, monkeypatch):
    """huggingface_hub pointed at the laid-out cache, offline, in this process."""
    from huggingface_hub import constants

    home, snaps, src = hub_cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home, snaps, src


def test_local_path_then_name_then_hub_id(hub_here, tmp_path, monkeypatch, checkpoint):
    home, snaps, _ = hub_here
    monkeypatch.chdir(tmp_path)
    assert resolve_model(HUB_ID) == str(snaps["main"])
    # A local directory of the same relative path holding a model comes first, as in vLLM.
    local = tmp_path / HUB_ID
    local.parent.mkdir()
    local.symlink_to(checkpoint("qwen2"), target_is_directory=True)
    assert resolve_model(HUB_ID) == str(local.resolve())
    # A directory named like a model name holds a model: the directory; an empty one: the name.
    (tmp_path / "kvserve-ref").symlink_to(checkpoint("qwen2"), target_is_directory=True)
    assert resolve_model("kvserve-ref") == str(Path(checkpoint("qwen2")).resolve())


def test_a_gguf_only_snapshot_goes_through_prepare_gguf(hub_here, tmp_path, monkeypatch):
    from huggingface_hub import constants

    src = tmp_path / "gguf-repo"
    src.mkdir()
    (src / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    snaps = lay_out(Path(constants.HF_HUB_CACHE), "org/tiny-GGUF", {"main": src})
    calls = []
    monkeypatch.setattr(resolve, "_prepare_gguf", lambda p: calls.append(p) or "prepared")
    assert resolve_model("org/tiny-GGUF") == "prepared"
    assert calls == [(snaps["main"] / "tiny.Q4_0.gguf").resolve()]


def test_revision_given_twice_must_agree(hub_here):
    from kvserve.config import ConfigError

    with pytest.raises(ConfigError, match=r"revision: .*'v2'.*'main'"):
        resolve_model(f"{HUB_ID}@v2", "main")


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", HubId("HuggingFaceTB/SmolLM2-135M-Instruct", None)),
        ("Qwen/Qwen2.5-0.5B@v1.0", HubId("Qwen/Qwen2.5-0.5B", "v1.0")),
        ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
        ("gpt2", None),  # a bare name is never sent to the hub
        ("/abs/path", None),
        ("./rel/dir", None),
        ("a/b/c", None),
        ("org/na..me", None),
        ("org/name@", None),
    ],
)
def test_parse_hub_id(name, parsed):
    assert parse_hub_id(name) == parsed


def fetched(files: list[str]) -> set[str]:
    """The files snapshot_download fetches with our patterns (huggingface_hub's own filter)."""
    from huggingface_hub.utils import filter_repo_objects

    return set(filter_repo_objects(files, allow_patterns=download_patterns("o/n", files)))


def test_download_fetches_config_tokenizer_and_one_weight_format():
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "consolidated.safetensors", "pytorch_model.bin",
             "onnx/model.onnx", "model.Q4_0.gguf", "README.md", ".gitattributes"]  # fmt: skip
    assert fetched(files) == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    }  # fmt: skip
    assert fetched(["README.md", "m.Q8_0.gguf", "params.json"]) == {"m.Q8_0.gguf"}
    with pytest.raises(FileNotFoundError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        download_patterns("o/n", ["a.gguf", "b.gguf"])
    with pytest.raises(FileNotFoundError, match=r"no model\*\.safetensors and no \.gguf"):
        download_patterns("o/n", ["config.json", "pytorch_model.bin"])


def test_llm_takes_a_hub_id_and_revision_and_hands_workers_the_snapshot(hub_here, make_llm):
    _, snaps, _ = hub_here
    llm = make_llm(HUB_ID, revision="v2", max_model_len=64, num_gpu_blocks=16)
    # v2 is llama_mha: four KV heads where main (llama_gqa) has two.
    assert llm.engine.model_config.num_key_value_heads == 4
    assert llm.engine.config.model == str(snaps["v2"])
