"""Admission control over real HTTP with the official ``openai`` client: ``priority`` and
``workload_class`` as extra body fields, bad values as a 400 naming the field, refusals as a
429 with Retry-After (streamed or not) that leave the engine idle, and per-class metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import BadRequestError, OpenAI, RateLimitError

from kvserve import LLM
from kvserve.server.app import BackgroundServer, build_state
from kvserve.server.tenants import TenantResolver
from tests.test_server import scrape, wait_idle

MODEL = "tiny-llama"
CLASSES = {
    "classes": [
        # A TTFT SLO of a microsecond: it has always passed by the engine's next step.
        {"name": "strict", "match": {"users": ["impatient"]}, "slo": {"ttft_ms": 0.001}},
        {"name": "chat", "match": {"prompt_tokens": [0, 64]}, "priority": 0,
         "slo": {"ttft_ms": 60000, "tpot_ms": 60000}, "output_estimate": "learned"},
        {"name": "batch", "priority": 5},
    ]
}  # fmt: skip


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("classes") / "classes.json"
    path.write_text(json.dumps(CLASSES))
    llm = LLM(checkpoint("llama_gqa"), max_model_len=256, dtype="float32", max_num_seqs=8,
              admission="projected", scheduling_policy="priority",
              workload_classes=str(path))  # fmt: skip
    state = build_state(llm.engine, [MODEL], TenantResolver({}), max_queue=64)
    with BackgroundServer(state) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _idle_after(server):
    yield
    wait_idle(server.state)


@pytest.fixture
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_priority_and_class_from_the_openai_client(server, client):
    before = scrape(server.url)
    key = ("kvserve:class_requests_total", (("outcome", "finished"), ("workload_class", "chat")))
    good = ("kvserve:class_goodput_requests_total", (("workload_class", "chat"),))
    r = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4,
                                  temperature=0, extra_body={"priority": -3})  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")
    batch_class = {"workload_class": "batch"}
    r = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4,
                                  temperature=0, extra_body=batch_class)  # fmt: skip
    assert r.choices[0].text is not None
    after = scrape(server.url)
    assert after[key] - before.get(key, 0.0) == 1  # the first matched chat by its length
    assert after[good] - before.get(good, 0.0) == 1  # its loose SLO was met
    batch = ("kvserve:class_requests_total", (("outcome", "finished"), ("workload_class", "batch")))
    assert after[batch] - before.get(batch, 0.0) == 1


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"priority": "high"}, "priority"),
        ({"priority": 2**40}, "priority"),
        ({"priority": True}, "priority"),
        ({"workload_class": "nope"}, "workload_class"),
        ({"workload_class": 3}, "workload_class"),
    ],
)
def test_bad_priority_or_class_is_a_400_naming_the_field(client, extra, field):
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
    assert field in str(e.value)
    if extra.get("workload_class") == "nope":
        assert "strict" in str(e.value) and "batch" in str(e.value)  # the allowed names


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_request_is_a_429_with_retry_after(server, client, stream):
    before = scrape(server.url)
    with pytest.raises(RateLimitError) as e:
        r = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=stream,
                                      user="impatient")  # fmt: skip
        if stream:
            list(r)
    assert int(e.value.response.headers["Retry-After"]) >= 1
    assert "deadline" in str(e.value)
    after = scrape(server.url)
    key = ("kvserve:requests_refused_total", (("reason", "deadline"),))
    assert after[key] - before.get(key, 0.0) == 1
    cls = ("kvserve:class_requests_total", (("outcome", "refused"), ("workload_class", "strict")))
    assert after[cls] - before.get(cls, 0.0) == 1
    status = ("kvserve:request_rejected_total", (("status", "429"),))
    assert after[status] - before.get(status, 0.0) == 1  # counted once


def test_the_server_answers_on_after_refusals(server, client):
    """Refusals free what they held: other requests are served exactly as before."""
    for _ in range(3):
        with pytest.raises(RateLimitError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="impatient")
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi",
                   "max_tokens": 3, "temperature": 0, "ignore_eos": True}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
