"""The OpenAI-compatible server through real HTTP: uvicorn on 127.0.0.1 and an ephemeral port,
driven with the official ``openai`` client (and ``httpx`` where the client would hide the wire).

One server per module (building engines is the slow part); after every test the engine must
be idle again with no block in use and its pool invariants intact.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from kvserve.server.app import BackgroundServer, build_state
from kvserve.server.tenants import TenantResolver
from tests.serve_process import ServeProcess

MODEL = "tiny-llama"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
REPO = Path(__file__).resolve().parent.parent


def engine_call(state, fn):
    """Run ``fn(engine)`` on the engine thread (the engine is not thread-safe)."""
    return asyncio.run(state.loop.call(fn))


def wait_idle(state, timeout: float = 10.0) -> None:
    """Wait until the engine holds no request and no block, then check pool invariants."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = state.loop.stats
        if s.num_running == s.num_waiting == s.kv_blocks_used == 0 and not state.loop.admitted_seqs:
            break
        time.sleep(0.02)
    s = state.loop.stats
    assert (s.num_running, s.num_waiting, s.kv_blocks_used) == (0, 0, 0), f"not idle: {s}"
    assert state.loop.admitted_seqs == 0
    assert (
        engine_call(state, lambda e: (e.kv.check_invariants(), e.has_unfinished_requests()))[1]
        is False
    )


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, via prometheus_client's parser."""
    text = httpx.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("llama_gqa")


@pytest.fixture(scope="module")
def server(ckpt):
    llm = LLM(ckpt, max_model_len=256, dtype="float32", max_num_seqs=32)
    state = build_state(llm.engine, [MODEL, "alias"], TenantResolver(KEYS), max_queue=64)
    with BackgroundServer(state) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "server" in request.fixturenames:
        wait_idle(request.getfixturevalue("server").state)


@pytest.fixture
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(ckpt):
    """The offline API on the same checkpoint: what the server must reproduce exactly."""
    return LLM(ckpt, max_model_len=256, dtype="float32")


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    assert httpx.get(server.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-alice"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad = OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    with pytest.raises(NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404 and err.value.body["param"] == "model"


def test_completion_and_usage(client, reference):
    prompt = "The pass code for the vault is"
    r = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    n_prompt = len(reference.get_tokenizer().encode(prompt))
    (choice,) = r.choices
    assert choice.finish_reason == "length" and r.object == "text_completion"
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == n_prompt + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # The same request again: its full prompt blocks come from the prefix cache.
    again = client.completions.create(model="alias", prompt=prompt, **GREEDY)
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens_details.cached_tokens == (n_prompt - 1) // 16 * 16


def test_greedy_http_equals_llm_generate(client, reference):
    prompts = ["Hello world", "Once upon a time in a land far away", "0123456789"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = reference.generate(prompts, params)
    for prompt, w in zip(prompts, want, strict=True):
        got = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert got.choices[0].text == w.outputs[0].text
    # Token-id prompts, batched into one HTTP request.
    ids = [w.prompt_token_ids for w in want]
    got = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    # Chat goes through the model's chat template exactly as LLM.chat does.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    w = reference.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == w.outputs[0].text
    assert r.usage.prompt_tokens == len(w.prompt_token_ids)


def _stream_texts(stream, n: int) -> tuple[list[str], list[str | None], object]:
    texts, reasons, usage = [""] * n, [None] * n, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] += piece
            if c.finish_reason is not None:
                assert reasons[c.index] is None, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_streaming_equals_non_streaming(client, reference):
    prompt = "Streaming must not change a single character"
    full = client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text
    # A 3-character stop string completes over several steps: none of it may be streamed.
    stop = full[5:8]
    cases = [
        dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True}),
        dict(temperature=0, max_tokens=12, stop=[stop], extra_body={"ignore_eos": True}),
        dict(temperature=1.0, seed=3, n=2, max_tokens=10, extra_body={"ignore_eos": True}),
    ]
    for kw in cases:
        n = kw.get("n", 1)
        plain = client.completions.create(model=MODEL, prompt=prompt, **kw)
        stream = client.completions.create(
            model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        )
        texts, reasons, usage = _stream_texts(stream, n)
        assert texts == [c.text for c in plain.choices]
        assert reasons == [c.finish_reason for c in plain.choices]
        assert usage.completion_tokens == plain.usage.completion_tokens
        assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert plain.choices[0].text != plain.choices[1].text  # n=2 samples differ
    messages = [{"role": "user", "content": prompt}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, stop=stop, **GREEDY)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, stop=stop, stream=True, **GREEDY
    )
    texts, reasons, usage = _stream_texts(stream, 1)
    assert usage is None  # include_usage not requested
    assert texts == [plain.choices[0].message.content]
    assert reasons == [plain.choices[0].finish_reason]


def test_stream_wire_format(server):
    """SSE framing: role first (chat), one usage chunk with empty choices, then [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer key-bob"}) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_strings_and_tokens(client):
    prompt = "Stop right there"
    full = client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0]
    stop = full.text[4:6]
    r = client.completions.create(model=MODEL, prompt=prompt, stop=[stop], **GREEDY).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == full.text[: full.text.index(stop)]
    assert r.model_extra["stop_reason"] == stop


def test_seed_reproducibility_and_n(client):
    kw = dict(model=MODEL, prompt="Roll the dice:", temperature=1.0, max_tokens=16)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b and a != c
    r = client.completions.create(seed=7, n=2, **kw)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[0].text == a  # sample 0 of a seeded request uses the seed itself
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 32
    # Two prompts x n=2: choice index = prompt * n + sample, as OpenAI numbers them.
    r = client.completions.create(seed=7, n=2, **{**kw, "prompt": ["Roll the dice:", "Flip"]})
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == a
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two"}], n=2, max_tokens=8, seed=1
    )
    assert len(chat.choices) == 2 and chat.usage.completion_tokens <= 16


def test_logit_bias_and_allowed_token_ids_over_http(client, reference):
    """OpenAI's logit_bias (string keys) and vLLM's allowed_token_ids reach the sampler: the
    text equals the offline API's with the same parameters, whose tokens obey them."""
    prompt = "Bias the next words"
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = reference.generate([prompt], base)[0].outputs[0].token_ids
    forced = next(t for t in range(40, 320) if t not in plain)
    want = reference.generate([prompt], base.clone(logit_bias={forced: 100}))[0].outputs[0]
    assert want.token_ids == [forced] * 12
    r = client.completions.create(model=MODEL, prompt=prompt, logit_bias={str(forced): 100},
                                  **GREEDY)  # fmt: skip
    assert r.choices[0].text == want.text
    allowed = [t for t in range(40, 320, 7) if t not in plain]
    want = reference.generate([prompt], base.clone(allowed_token_ids=allowed))[0].outputs[0]
    assert set(want.token_ids) <= set(allowed)
    r = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed},
    )  # fmt: skip
    assert r.choices[0].text == want.text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == reference.get_tokenizer().decode([forced] * 4)
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, logit_bias={"5": 101}, **GREEDY)
    assert err.value.status_code == 400 and err.value.body["param"] == "logit_bias"


def test_logprobs_shapes(client):
    r = client.completions.create(model=MODEL, prompt="abc", logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for tok, top, sampled in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) >= 2 and sampled <= 0  # sampled token + top 2 (they may coincide)
        assert top[tok] == sampled == pytest.approx(max(top.values()))  # greedy = the top token
        # One byte per token (byte-level vocab), or an id beyond the tokenizer's vocab.
        assert tok.startswith(("bytes:\\x", "token_id:")) or len(tok.encode()) == 1
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3,
        **GREEDY,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert len(entry.bytes) == 1 or entry.token.startswith("token_id:")
        assert entry.token.startswith("bytes:") or entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], **GREEDY
    )
    assert plain.choices[0].logprobs is None


def test_tenant_isolation_over_http(server):
    """Tenant B never hits tenant A's cache, even sending A's client salt; A still hits."""
    prompt = "Shared system prompt that tenant A sends first. " * 3  # > 8 blocks of 16
    n_full = (len(prompt) + 1 - 1) // 16 * 16  # BOS + bytes; the last token is always computed

    def ask(key: str, salt: str | None = None) -> int:
        c = OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert ask("key-alice", "team-1") == 0  # cold
    assert ask("key-alice", "team-1") == n_full  # warm for A
    assert ask("key-bob", "team-1") == 0  # B sends A's salt: still a miss
    assert ask("key-bob") == 0  # B without salt: a miss too
    assert ask("key-alice") == 0  # A's other client partition is separate
    assert ask("key-alice", "team-1") == n_full  # A is still warm
    assert ask("key-bob", "team-1") == n_full  # B now hits its own copy


def test_metrics_move_as_expected(server, client):
    def delta(before, after, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    e = {"model_name": MODEL, "engine": "0"}  # vLLM's labels: the first served name
    info = [k for k in scrape(server.url) if k[0] == "vllm:cache_config_info"]
    assert dict(info[0][1])["block_size"] == "16"
    assert dict(info[0][1])["cache_dtype"] == "float32"
    assert int(dict(info[0][1])["num_gpu_blocks"]) == server.state.loop.engine.num_blocks
    assert dict(info[0][1])["kv_layer_groups"] == "1"  # every layer attends everything

    prompt = "Metrics prompt number one, long enough for two blocks."
    n_prompt = len(prompt) + 1
    m0 = scrape(server.url)
    r1 = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    r2 = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert cached == (n_prompt - 1) // 16 * 16 > 0
    m1 = scrape(server.url)
    assert delta(m0, m1, "vllm:generation_tokens_total", **e) == 24
    assert delta(m0, m1, "vllm:prompt_tokens_total", **e) == 2 * n_prompt  # hits included
    assert delta(m0, m1, "vllm:prefix_cache_queries_total", **e) == 2 * n_prompt
    assert delta(m0, m1, "vllm:prefix_cache_hits_total", **e) == cached
    assert delta(m0, m1, "vllm:request_success_total", finished_reason="length", **e) == 2
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):  # fmt: skip
        assert delta(m0, m1, f"vllm:{h}_count", **e) == 2
        assert delta(m0, m1, f"vllm:{h}_sum", **e) > 0
    assert delta(m0, m1, "vllm:inter_token_latency_seconds_count", **e) == 2 * 11
    key = tuple(sorted(e.items()))
    assert m1[("vllm:kv_cache_usage_perc", key)] == 0.0
    assert m1[("vllm:num_requests_running", key)] == 0.0


def test_engine_shutdown_aborts_in_flight(ckpt):
    """Stopping the engine loop (the last step of graceful shutdown) ends open streams with
    an error event and frees their blocks."""
    llm = LLM(ckpt, max_model_len=256, dtype="float32")
    state = build_state(llm.engine, [MODEL])
    with BackgroundServer(state) as srv:
        body = {"prompt": "long one", "max_tokens": 240, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            state.loop.shutdown()
            rest = [line for line in lines if line]
        assert json.loads(rest[-2][6:])["error"]["type"] == "service_unavailable_error"
        assert rest[-1] == "data: [DONE]"
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["message"]
    assert llm.engine.kv.num_used_blocks == 0
    llm.engine.kv.check_invariants()


def test_cli_serve_sigterm_finishes_in_flight_and_exits_0(ckpt, tmp_path):
    """`kvserve serve MODEL` as a process: SIGTERM mid-stream lets the stream finish, exit 0."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"k1": "t1"}))
    args = [ckpt, "--max-model-len", "256", "--dtype", "float32", "--tenants", str(tenants),
            "--served-model-name", MODEL, "--disable-access-log"]  # fmt: skip
    with ServeProcess(args) as srv:
        c = OpenAI(base_url=srv.url + "/v1", api_key="k1", max_retries=0)
        stream = c.completions.create(model=MODEL, prompt="bye", max_tokens=150, stream=True,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        chunks = [next(stream)]
        srv.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert srv.stop() == 0, srv.text


def test_engine_stream_deltas_hold_back_stop_prefixes(checkpoint, make_llm):
    """Engine-level: streamed deltas never include text that a later stop string cuts."""
    from kvserve import SamplingParams

    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = llm.generate(["hold back"], base)[0].outputs[0].text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3)
                if text[i : i + 3].isprintable() and text.index(text[i : i + 3]) == i)  # fmt: skip
    engine = llm.engine
    engine.add_request("s", "hold back", base.clone(stop=[stop]), stream=True)
    streamed = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed += o.outputs[0].text if o.outputs else ""
            assert stop not in streamed
    assert streamed == text[: text.index(stop)]
