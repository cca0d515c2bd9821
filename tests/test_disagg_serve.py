"""Disaggregated serving over real processes: a prefill ``kvserve serve`` and a decode one,
each with ``--kv-transfer-config``, behind the proxy (kvserve.disagg.proxy). The proxy's
greedy text equals a colocated engine's (an in-process engine with no connector), streamed
and not; usage counts the transferred prompt apart from cached tokens; a decode engine that
is gone is a clear 502."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.disagg.proxy import Proxy, build_app
from kvserve.distributed import free_port
from tests.serve_process import ServeProcess

PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank today"


def _args(ckpt: str, role: str, port: int) -> list[str]:
    tc = {"kv_connector": "KVServeConnector", "kv_role": role, "kv_port": port}
    return ["--model", ckpt, "--dtype", "float32", "--block-size", "8", "--num-gpu-blocks", "64",
            "--max-model-len", "256", "--enable-prefix-caching", "--disable-access-log",
            "--kv-transfer-config", json.dumps(tc)]  # fmt: skip


async def _calls(app, body):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=60) as c:
        plain = await c.post("/v1/completions", json=body)
        chunks = []
        async with c.stream("POST", "/v1/completions",
                            json={**body, "stream": True,
                                  "stream_options": {"include_usage": True}}) as r:  # fmt: skip
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return plain, chunks


async def _one(app, body):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=60) as c:
        return await c.post("/v1/completions", json=body)


def test_proxy_prefill_and_decode_processes_give_the_colocated_text(checkpoint, make_llm):
    ckpt = checkpoint("llama_gqa")
    colocated = make_llm(ckpt, dtype="float32", block_size=8, num_gpu_blocks=64)
    want = colocated.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))[0]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(ServeProcess, _args(ckpt, role, free_port()))
                  for role in ("kv_producer", "kv_consumer")]  # fmt: skip
        p, d = (f.result() for f in starts)
    with p, d:
        proxy = Proxy([p.url], [d.url])
        app = build_app(proxy)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        plain, chunks = asyncio.run(_calls(app, body))
        assert plain.status_code == 200, plain.text
        out = plain.json()
        assert out["choices"][0]["text"] == want.outputs[0].text
        usage = out["usage"]
        n_prompt = len(want.prompt_token_ids)
        assert usage["prompt_tokens"] == n_prompt and usage["completion_tokens"] == 8
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert usage["kv_transfer"]["transferred_tokens"] == n_prompt
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == want.outputs[0].text
        # The second request's full blocks are in the decode engine's prefix cache: cached,
        # and only the partial block travels.
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt // 8 * 8
        metrics = httpx.get(d.url + "/metrics", timeout=10).text
        got = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
               if line.startswith("kvserve:kv_transfer")}  # fmt: skip
        n_blocks = -(-n_prompt // 8)
        assert got['kvserve:kv_transfer_blocks_total{direction="received"}'] == n_blocks + 1
        assert got['kvserve:kv_transfer_bytes_total{direction="received"}'] > 0
        assert got["kvserve:kv_transfers_total"] == 2
        # the first request's whole prompt and the second's partial block, not cache hits
        assert got["kvserve:kv_transfer_tokens_total"] == n_prompt + n_prompt % 8
        hits = [line for line in metrics.splitlines()
                if line.startswith("kvserve:kv_offload_hit_tokens_total")]  # fmt: skip
        assert all(float(line.split(" ")[1]) == 0 for line in hits)
        # n and stop strings pass through (n > 1: the decode engine samples every sequence
        # itself, from the last prompt token on).
        text = want.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        r = asyncio.run(_one(build_app(Proxy([p.url], [d.url])), {**body, "n": 2, "stop": [stop]}))
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [text[: text.index(stop)]] * 2
        # A malformed answer is the client's 400, naming the field.
        bad = {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}}
        r = httpx.post(d.url + "/v1/completions", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert "kv_transfer_params.remote_host" in r.json()["error"]["message"]
        # A decode engine that is gone: a clear error, not a hang or a silent recompute.
        assert d.stop() == 0
        r = asyncio.run(_one(build_app(Proxy([p.url], [d.url])), body))
        assert r.status_code == 502 and "decode engine" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--prefill", "127.0.0.1:8001", "--decode", "http://127.0.0.1:8002"],
         "argument --prefill: expected an engine's base URL (http://HOST:PORT), got "
         "'127.0.0.1:8001'"),
        (["--prefill", "http://127.0.0.1:8001", "--decode", "http://127.0.0.1:8002",
          "--timeout", "0"], "argument --timeout: expected seconds > 0, got '0'"),
        (["--prefill", "http://127.0.0.1:8001"], "the following arguments are required: --decode"),
    ],
)  # fmt: skip
def test_proxy_refuses_bad_flags_naming_them(argv, expected, capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["proxy", *argv])
    assert e.value.code == 2
    assert expected in capsys.readouterr().err
