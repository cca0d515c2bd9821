"""KV retention (``--kv-retention window:W``) and the model's own sliding window: blocks behind
the window really return to the pool, outputs equal an independent reference, prefix caching
stays lossless for everyone else, and bad input is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.config import ConfigError
from kvserve.sched.request import InvalidRequestError, RequestOutput
from kvserve.sched.retention import RetentionSpec, parse_retention
from kvserve.server.app import BackgroundServer, build_state
from tests.conftest import prompts_of_lengths
from tests.test_exactness import hf_greedy

transformers = pytest.importorskip("transformers")

LENGTHS = [5, 40, 90, 128]
NEW = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def sliding_window_reference(path: str, prompts: list[list[int]], window: int) -> list[list[int]]:
    """Greedy tokens of the same weights in transformers' Mistral, whose attention is the
    Llama one plus a sliding-window mask: a full recompute with the mask ``window:W`` means."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    return hf_greedy(
        path, prompts, NEW, config=transformers.MistralConfig(**cfg, sliding_window=window)
    )


def tokens(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama_gqa")


@pytest.fixture(scope="module")
def windowed_reference(llama):
    prompts = prompts_of_lengths(LENGTHS, seed=11)
    return prompts, sliding_window_reference(llama, prompts, 24)


# -- exactness --------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [2048, 16])
def test_window_equals_a_sliding_window_recompute(llama, make_llm, windowed_reference, budget):
    prompts, expected = windowed_reference
    full = tokens(make_llm(llama, dtype="float32", block_size=8), prompts)
    assert full != expected, "the window must change the output, or this test proves nothing"
    llm = make_llm(llama, dtype="float32", block_size=8, kv_retention="window:24",
                   max_num_batched_tokens=budget)  # fmt: skip
    assert tokens(llm, prompts) == expected
    s = llm.engine.stats()
    assert s.retention_reclaimed_blocks > 0
    assert s.retention_evicted_tokens["window:24"] == 8 * s.retention_reclaimed_blocks


def test_window_per_request_override_and_none(llama, make_llm, windowed_reference):
    prompts, expected = windowed_reference
    llm = make_llm(llama, dtype="float32", block_size=8, kv_retention="window:24")
    plain = make_llm(llama, dtype="float32", block_size=8)
    # Per request: "none" turns the engine's default off; a policy turns it on.
    off = GREEDY.clone(kv_retention="none")
    assert tokens(llm, prompts[:2], off) == tokens(plain, prompts[:2])
    on = GREEDY.clone(kv_retention="window:24")
    assert tokens(plain, prompts, on) == expected


def test_window_under_preemption(llama, make_llm, windowed_reference):
    prompts, expected = windowed_reference
    llm = make_llm(llama, dtype="float32", block_size=8, kv_retention="window:24",
                   num_gpu_blocks=12, max_num_batched_tokens=32)  # fmt: skip
    assert tokens(llm, prompts) == expected


class StreamingReference:
    """StreamingLLM as its paper describes it, token by token, in plain torch on a Llama
    checkpoint's weights: per layer the kept keys (before RoPE) and values; each token's
    query sees the first ``sinks`` tokens and the ``window`` most recent (itself included),
    every one rotated at its index in that kept list (positions inside the cache)."""

    def __init__(self, path: str) -> None:
        from safetensors.torch import load_file

        self.cfg = json.loads((Path(path) / "config.json").read_text())
        self.w = {k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()}

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])
        )

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [N, heads, D]
        d = x.shape[-1]
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        ang = pos.float()[:, None] * inv[None, :]
        cos, sin = (
            torch.cat([ang, ang], -1).cos()[:, None],
            torch.cat([ang, ang], -1).sin()[:, None],
        )
        rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    def greedy(self, prompt: list[int], n_new: int, sinks: int, window: int) -> list[int]:
        c, w = self.cfg, self.w
        heads, kvh = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["head_dim"]
        layers = c["num_hidden_layers"]
        kept: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]
        tokens, out = list(prompt), []
        t = 0
        while len(out) < n_new:
            h = w["model.embed_tokens.weight"][tokens[t]][None]
            for i in range(layers):
                pre = f"model.layers.{i}."
                x = self._norm(h, w[pre + "input_layernorm.weight"])
                q = (x @ w[pre + "self_attn.q_proj.weight"].T).view(1, heads, d)
                k = (x @ w[pre + "self_attn.k_proj.weight"].T).view(1, kvh, d)
                v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(1, kvh, d)
                cache = [e for e in kept[i] if e[0] < sinks or e[0] > t - window] + [(t, k, v)]
                kept[i] = cache
                ks = torch.cat([e[1] for e in cache])
                vs = torch.cat([e[2] for e in cache])
                pos = torch.arange(len(cache))  # positions inside the cache
                qr = self._rope(q, pos[-1:])
                kr = self._rope(ks, pos).repeat_interleave(heads // kvh, 1)
                att = torch.einsum("qhd,shd->hqs", qr, kr) / d**0.5
                o = torch.einsum(
                    "hqs,shd->qhd", att.softmax(-1), vs.repeat_interleave(heads // kvh, 1)
                )
                h = h + o.reshape(1, -1) @ w[pre + "self_attn.o_proj.weight"].T
                x = self._norm(h, w[pre + "post_attention_layernorm.weight"])
                g = torch.nn.functional.silu(x @ w[pre + "mlp.gate_proj.weight"].T)
                h = (
                    h
                    + (g * (x @ w[pre + "mlp.up_proj.weight"].T))
                    @ w[pre + "mlp.down_proj.weight"].T
                )
            t += 1
            if t == len(tokens):
                x = self._norm(h, w["model.norm.weight"])
                tok = int((x @ w["lm_head.weight"].T).argmax())
                tokens.append(tok)
                out.append(tok)
        return out


_STREAMING: dict[tuple[int, int], list[list[int]]] = {}


@pytest.fixture(scope="module")
def streaming(llama):
    return StreamingReference(llama)


def test_streaming_reference_is_the_model_when_nothing_is_evicted(llama, streaming):
    prompt = prompts_of_lengths([20], seed=4)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=16, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert streaming.greedy(prompt, 16, sinks=1000, window=1000) == g[0, 20:].tolist()


@pytest.mark.parametrize("spec, sinks, window", [("sinks:4,window:24", 4, 24),
                                                 ("sinks:12,window:16", 12, 16)])  # fmt: skip
# budget 16: chunks that cross the window; "reference": no kernels, the per-sequence path
@pytest.mark.parametrize("budget, path", [(2048, "fused"), (16, "fused"), (16, "reference")])
def test_sinks_equal_streaming_llm_with_in_cache_positions(llama, make_llm, streaming, spec,
                                                           sinks, window, budget, path,
                                                           monkeypatch):  # fmt: skip
    if path == "reference":
        monkeypatch.setattr(kernels, "DISABLED", True)
    prompts = prompts_of_lengths([5, 70], seed=12)
    key = (sinks, window)
    if key not in _STREAMING:  # the reference is slow (token by token): once per policy
        expected = [streaming.greedy(p, 40, sinks, window) for p in prompts]
        windowed = streaming.greedy(prompts[1], 40, 0, window)
        assert expected[1] != windowed, "the sinks must matter, or this test proves nothing"
        _STREAMING[key] = expected
    expected = _STREAMING[key]
    llm = make_llm(llama, dtype="float32", block_size=8, kv_retention=spec,
                   max_num_batched_tokens=budget)  # fmt: skip
    assert tokens(llm, prompts, GREEDY.clone(max_tokens=40)) == expected
    assert llm.engine.stats().retention_reclaimed_blocks > 0


def test_sinks_stream_past_the_position_limit(checkpoint, make_llm):
    path = checkpoint("llama_gqa", max_position_embeddings=64)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        make_llm(path, dtype="float32", max_model_len=256)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        make_llm(path, dtype="float32", max_model_len=256, kv_retention="window:128")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        make_llm(path, dtype="float32", max_model_len=256, kv_retention="window:50%")
    make_llm(path, dtype="float32", max_model_len=256, kv_retention="window:64")  # streams
    llm = make_llm(path, dtype="float32", block_size=8, max_model_len=256,
                   kv_retention="sinks:4,window:28")  # fmt: skip
    prompt = prompts_of_lengths([30], seed=9)[0]
    out = llm.generate([prompt], GREEDY.clone(max_tokens=200))[0]
    assert len(out.outputs[0].token_ids) == 200  # 230 tokens through a 64-position model
    assert out.num_retained_tokens <= 4 + 28 + 8 + 8
    assert out.outputs[0].token_ids == StreamingReference(path).greedy(prompt, 200, 4, 28)


# -- memory -----------------------------------------------------------------------------------
def decode_and_watch(
    llm: LLM, prompt: list[int], max_tokens: int
) -> tuple[list[int], RequestOutput]:
    """Blocks in use after each step of one greedy request, and its final output."""
    eng = llm.engine
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))  # fmt: skip
    used, outs = [], []
    while eng.has_unfinished_requests():
        outs += eng.step()
        used.append(eng.kv.num_used_blocks)
    return used, [o for o in outs if o.finished][0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "int8", "kivi4", "kivi2"])
@pytest.mark.parametrize("spec, sink_blocks", [("window:32", 0), ("sinks:4,window:32", 1)])
def test_blocks_return_to_the_pool_while_decoding(llama, make_llm, kv_cache_dtype, spec,
                                                  sink_blocks):  # fmt: skip
    prompt = prompts_of_lengths([40], seed=3)[0]
    # A small pool: the suite checks every block after every step.
    kw = dict(dtype="float32", block_size=8, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=40,
              max_num_seqs=4, enable_prefix_caching=False)  # fmt: skip
    used, _ = decode_and_watch(make_llm(llama, kv_retention=spec, **kw), prompt, 160)
    # A query at entry c reads entries c-31..c: at most 5 blocks of 8, plus the one filling
    # (and the sink block).
    assert max(used[5:]) <= 32 // 8 + 2 + sink_blocks
    assert used[-2] <= used[5] + 1, "the count must stay flat, not grow with the sequence"
    assert used[-1] == 0
    full, _ = decode_and_watch(make_llm(llama, **kw), prompt, 160)
    assert max(full) == -(-(40 + 159) // 8)  # everything kept: one block per 8 entries


def test_model_native_window_frees_blocks_exactly(checkpoint, make_llm):
    path = checkpoint("mistral_swa")  # sliding_window 24 on every layer
    llm = make_llm(path, dtype="float32", block_size=8, enable_prefix_caching=False)
    assert llm.engine.native_window == 24
    used, _ = decode_and_watch(llm, prompts_of_lengths([40], seed=3)[0], 120)
    assert max(used[5:]) <= 24 // 8 + 2
    assert llm.engine.stats().retention_evicted_tokens["sliding_window"] > 0
    # Exactness of the same model against transformers is test_exactness.py's job (it runs
    # mistral_swa through this same freeing path).


# -- prefix caching ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["window:16", "sinks:4,window:16"])
def test_prefix_caching_stays_lossless_for_other_requests(llama, make_llm, spec):
    shared = prompts_of_lengths([64], seed=5)[0]
    others = [shared + p for p in prompts_of_lengths([9, 20, 33], seed=6)]
    alone = tokens(make_llm(llama, dtype="float32", block_size=8), others)
    llm = make_llm(llama, dtype="float32", block_size=8)
    retaining = GREEDY.clone(kv_retention=spec)
    # The retaining request runs first, publishes its (policy-salted) blocks, then runs
    # beside the others in one batch.
    llm.generate([shared + [1, 2, 3]], retaining)
    mixed = llm.generate([shared + [1, 2, 3], *others], [retaining] + [GREEDY] * 3)
    assert [o.outputs[0].token_ids for o in mixed[1:]] == alone
    assert mixed[0].num_retained_tokens < mixed[0].num_seen_tokens
    assert mixed[1].num_retained_tokens is None  # keeps everything


def test_retaining_requests_share_blocks_with_their_own_policy(llama, make_llm):
    prompt = prompts_of_lengths([80], seed=8)[0]
    llm = make_llm(llama, dtype="float32", block_size=8)
    p = GREEDY.clone(kv_retention="window:32", max_tokens=4)
    first = llm.generate([prompt], p)[0]
    again = llm.generate([prompt], p)[0]
    assert again.num_cached_tokens > 0, "the same policy and tokens reuse the same K/V"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    plain = llm.generate([prompt], GREEDY.clone(max_tokens=4))[0]
    assert plain.num_cached_tokens == 0, "an exact request never reads a retaining one's K/V"


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, words",
    [
        ("lru:5", "unknown policy 'lru'"),
        ("window", "is not KEY:VALUE"),
        ("window:abc", "expected an integer"),
        ("window:0%", "[1%, 100%]"),
        ("window:-4", "must be >= 0"),
        ("window:32,sinks:4", "window takes window, not sinks"),
        ("sinks:0,window:32", "sinks must be >= 1"),
        ("sinks:4", "sinks needs a window too"),
        ("sinks:4,window:8", "at least the block size (16)"),
        ("window:4", "at least the block size (16)"),
        ("snapkv:8", "at least the block size (16)"),
        ("snapkv:64,obs:0", "obs: the observation window must be in [1, 1024]"),
        ("snapkv:64,kernel:4", "kernel: the pooling width must be odd"),
        ("snapkv:64,window:8", "snapkv takes kernel, obs, snapkv, not window"),
        ("snapkv:150%", "[1%, 100%]"),
        ("h2o:8", "h2o: the budget must be at least the block size (16)"),
        ("h2o:64,recent:64", "recent: must be below the budget (64)"),
        ("h2o:64,obs:8", "h2o takes h2o, recent, not obs"),
    ],
)
def test_bad_policies_are_refused_by_name(llama, make_llm, spec, words):
    with pytest.raises(ConfigError, match="kv_retention") as e:
        make_llm(llama, dtype="float32", kv_retention=spec)
    assert words in str(e.value)
    llm = make_llm(llama, dtype="float32")
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[1, 2, 3]], GREEDY.clone(kv_retention=spec))
    assert e.value.field == "kv_retention" and words in str(e.value)
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_spec_parsing():
    assert parse_retention(None) is None and parse_retention("none") is None
    spec = parse_retention("window:50%")
    assert spec == RetentionSpec("window", percent=50)
    assert spec.for_prompt(100, 16) == RetentionSpec("window", window=50, label="window:50%")
    assert spec.for_prompt(10, 16).window == 16  # at least a block
    assert parse_retention(" window : 512 ").text() == "window:512"
    with pytest.raises(InvalidRequestError, match="kv_retention"):
        SamplingParams(kv_retention=512)  # type: ignore[arg-type]


# -- HTTP -------------------------------------------------------------------------------------
@pytest.mark.parametrize("allow", [True, False])
def test_http_override_usage_and_metrics(llama, allow):
    llm = LLM(llama, dtype="float32", block_size=8, max_model_len=256)
    state = build_state(llm.engine, ["m"], allow_kv_retention_override=allow)
    body = {"model": "m", "prompt": prompts_of_lengths([60], seed=2)[0], "max_tokens": 20,
            "temperature": 0, "ignore_eos": True, "kv_retention": "window:16"}  # fmt: skip
    with BackgroundServer(state) as srv:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "kv_retention": "lru:1"},
                         timeout=60)  # fmt: skip
        metrics = httpx.get(srv.url + "/metrics").text
    if not allow:
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "kv_retention" and "disabled" in err["message"]
        return
    assert r.status_code == 200, r.text
    kept = r.json()["usage"]["kv_retention"]
    assert kept["seen_tokens"] == 60 + 19 and kept["retained_tokens"] < kept["seen_tokens"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_retention"
    assert 'kvserve:kv_retention_evicted_tokens_total{policy="window:16"}' in metrics
