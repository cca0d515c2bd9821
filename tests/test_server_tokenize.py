"""vLLM's utility endpoints on kvserve's server: /tokenize and /detokenize against transformers'
tokenizer and chat template for the bundled model, /version, /ping, /docs and /openapi.json,
and ``kvserve --version`` against pyproject.toml."""

from __future__ import annotations

import random
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

import kvserve
from kvserve import LLM
from kvserve.server.app import BackgroundServer, build_state
from kvserve.server.tenants import TenantResolver
from tests.test_server import REPO, scrape

BUNDLED = str(Path(kvserve.__file__).parent / "bundled" / "kvserve-ref")
KEY = "sk-tok"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256
# ASCII, Latin accents, Cyrillic, CJK, 4-byte emoji (a skin-tone modifier), a combining accent,
# whitespace and digits: one to four UTF-8 bytes per character.
POOLS = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?'\"()-",
         "0123456789", " ", "\n\t", "éèàüößñçÅøœ", "приветмир", "日本語中文字漢",
         "😀🎉👍🏽🚀", "\u0301", "€£¥©®"]  # fmt: skip


def random_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(POOLS)) for _ in range(rng.randint(1, 40)))
            for _ in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    llm = LLM(BUNDLED, max_model_len=MAX_MODEL_LEN, dtype="float32")
    with BackgroundServer(build_state(llm.engine, ["ref"], TenantResolver({KEY: "t"}))) as srv:
        yield srv


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(BUNDLED)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)


def test_tokenize_round_trips_through_detokenize(server, hf):
    strings = random_strings(100)
    assert sum(len(s.encode()) > len(s) for s in strings) > 50  # multi-byte characters
    for s in strings:
        r = post(server, "/tokenize", {"model": "ref", "prompt": s, "add_special_tokens": False,
                                       "return_token_strs": True})  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        want = hf.encode(s, add_special_tokens=False)
        assert body == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want,
                        "token_strs": hf.convert_ids_to_tokens(want)}, s  # fmt: skip
        back = post(server, "/detokenize", {"model": "ref", "tokens": body["tokens"]})
        assert back.status_code == 200, back.text
        assert back.json() == {"prompt": s} and hf.decode(want) == s


def test_tokenize_adds_special_tokens_by_default(server, hf):
    r = post(server, "/tokenize", {"prompt": "Hello, wörld"}).json()
    assert r["tokens"] == hf.encode("Hello, wörld") and r["tokens"][0] == hf.bos_token_id
    assert r["token_strs"] is None  # vLLM's shape: the key is there, null unless asked for
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {
        "prompt": hf.decode(r["tokens"])  # special tokens kept, as vLLM's /detokenize
    }


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✨"},
        {"role": "assistant", "content": "Hello! How"}]  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [{}, {"add_generation_prompt": False},
     {"add_generation_prompt": False, "continue_final_message": True}],
)  # fmt: skip
def test_tokenize_chat_matches_the_transformers_template(server, hf, options):
    r = post(server, "/tokenize", {"messages": CHAT, **options})
    assert r.status_code == 200, r.text
    want = hf.apply_chat_template(CHAT, tokenize=True, return_dict=False,
                                  add_generation_prompt=options.get("add_generation_prompt", True),
                                  continue_final_message=options.get("continue_final_message",
                                                                     False))  # fmt: skip
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    bos = post(server, "/tokenize", {"messages": CHAT, **options, "add_special_tokens": True})
    assert bos.json()["tokens"] == [hf.bos_token_id, *want]


@pytest.mark.parametrize(
    "path, body, status, param, words",
    [
        ("/detokenize", {"tokens": [5, 4096]}, 400, "tokens", ["[0, 4096)", "4096", "index 1"]),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", ["[0, 4096)"]),
        ("/detokenize", {"tokens": ["5"]}, 400, "tokens[0]", []),
        ("/detokenize", {}, 400, "tokens", []),
        ("/detokenize", {"model": "nope", "tokens": [5]}, 404, "model", ["'ref'"]),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", ["'ref'"]),
        ("/tokenize", {"prompt": 5}, 400, "prompt", []),
        ("/tokenize", {"messages": [], "add_generation_prompt": True}, 400, "messages", []),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
         "continue_final_message", ["add_generation_prompt"]),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400,
         "tools[0].function", []),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, 400, "chat_template", []),
    ],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_field(server, path, body, status, param, words):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param.split("[")[0])
    for w in words:
        assert w in err["message"]


def test_an_unknown_tokenize_field_is_counted_and_no_key_is_needed(server, hf):
    """As vLLM, which guards only /v1 paths: its `bench serve` calls /tokenize without one."""
    key = ("kvserve:ignored_request_fields_total", (("field", "tokenize_extra"),))
    assert post(server, "/tokenize", {"prompt": "x", "tokenize_extra": 1}).status_code == 200
    assert scrape(server.url)[key] == 1
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(server.url + path, json=body, timeout=30).status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401


def _pyproject_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_version_ping_docs_and_openapi(server):
    url = server.url
    assert httpx.get(url + "/version").json() == {"version": _pyproject_version()}
    health = httpx.get(url + "/health")
    for ping in (httpx.get(url + "/ping"), httpx.post(url + "/ping")):
        assert (ping.status_code, ping.json()) == (health.status_code, health.json()) == (
            200, {"status": "ok"})  # fmt: skip
    docs = httpx.get(url + "/docs")
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in docs.text and "swagger" in docs.text.lower()
    spec = httpx.get(url + "/openapi.json").json()
    assert spec["info"]["version"] == _pyproject_version()
    paths = spec["paths"]
    assert {"/tokenize", "/detokenize", "/version", "/ping"} <= set(paths)
    assert set(paths["/ping"]) == {"get", "post"} and "post" in paths["/tokenize"]


def test_cli_version():
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "--version"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _pyproject_version()
