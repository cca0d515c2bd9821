"""Sampling: against naive references and distribution checks, not against itself."""

from __future__ import annotations

import pytest
import torch

from kvserve import SamplingParams
from kvserve.sample.builtin_processors import PenaltiesLogitsProcessor
from kvserve.sample.sampler import Sampler, SamplingState, _top_k_top_p
from tests.conftest import run_with_prompt_logits


def _req(params: SamplingParams, prompt=(1, 2, 3), output=()) -> SamplingState:
    return SamplingState(params, list(prompt), list(output))


def test_top_k_top_p_against_naive():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    cases = [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.3),
        SamplingParams(top_k=10, top_p=0.5),
        SamplingParams(),
    ]
    got = _top_k_top_p(logits.clone(), cases)
    for row, p in enumerate(cases):
        order = logits[row].argsort(descending=True).tolist()
        keep = order[: p.top_k] if p.top_k > 0 else order
        probs = torch.softmax(logits[row, keep], -1).tolist()
        kept, mass = [], 0.0
        for t, pr in zip(keep, probs, strict=True):
            if mass > p.top_p:
                break
            kept.append(t)
            mass += pr
        assert set(torch.isfinite(got[row]).nonzero().flatten().tolist()) == set(kept)


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(4, seed=1)
    reqs = [_req(SamplingParams(temperature=1.0))] * 4000
    tokens = torch.tensor(sampler(logits, reqs).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(3000, 1)
    sampler = Sampler(3, seed=2)
    cold = sampler(logits, [_req(SamplingParams(temperature=0.2))] * 3000).token_ids
    hot = sampler(logits, [_req(SamplingParams(temperature=2.0))] * 3000).token_ids
    assert cold.count(0) / 3000 > 0.98
    assert 0.4 < hot.count(0) / 3000 < 0.6


def test_min_p_removes_unlikely_tokens():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]]).repeat(2000, 1)
    out = Sampler(4, seed=3)(logits, [_req(SamplingParams(min_p=0.5))] * 2000).token_ids
    assert set(out) == {0, 1}


def test_penalties_against_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                       frequency_penalty=0.25)  # fmt: skip
    penalties = PenaltiesLogitsProcessor(4)
    state = penalties.new_state(_req(p, prompt=[2], output=[0, 0, 1]))
    got = penalties.apply(logits.clone(), [0], [state])
    # token 0: seen, >0 -> 2/2=1, minus 0.25*2 + 0.5 ; token 1: seen, <0 -> -1*2=-2, minus 0.25+0.5
    # token 2: in prompt only -> 0.5/2 = 0.25 ; token 3: unseen -> 0
    torch.testing.assert_close(got, torch.tensor([[0.0, -2.75, 0.25, 0.0]]))


def test_seed_reproducible_whatever_the_batch(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["seeded prompt"], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    mixed = llm.generate(["noise a", "seeded prompt", "noise b"], [others, p, others])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate(["seeded prompt"], p.clone(seed=43))[0].outputs[0].token_ids
    assert other_seed != alone


def test_logprobs_match_transformers(checkpoint, make_llm):
    transformers = pytest.importorskip("transformers")
    path = checkpoint("llama_gqa")
    llm = make_llm(path, dtype="float32")
    out = llm.generate(["logprob"], SamplingParams(temperature=0, max_tokens=3, logprobs=5,
                                                   ignore_eos=True))[0]  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    n = len(out.prompt_token_ids)
    for step, entry in enumerate(out.outputs[0].logprobs):
        row = lsm[n - 1 + step]
        top = row.topk(5)
        assert set(top.indices.tolist()) <= set(entry)
        for t, lp in entry.items():
            assert abs(lp - row[t].item()) < 1e-4


def test_stop_strings_and_tokens(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["stop test"], base)[0].outputs[0]
    ids = full.token_ids
    # stop on the 6th generated token id
    out = llm.generate(["stop test"], base.clone(stop_token_ids=[ids[5]]))[0].outputs[0]
    first = ids.index(ids[5])
    assert out.token_ids == ids[: first + 1] and out.stop_reason == ids[5]
    assert out.finish_reason == "stop"
    # stop on a printable substring of the text
    text = full.text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].isprintable()
                and text[i : i + 2].strip())  # fmt: skip
    out = llm.generate(["stop test"], base.clone(stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.finish_reason == "stop"
    out = llm.generate(["stop test"], base.clone(stop=[stop], include_stop_str_in_output=True))[0]
    assert out.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_min_tokens_and_eos(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    ids = llm.generate(["eos"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    first = ids.outputs[0].token_ids[0]
    # Treat the first greedy token as EOS via stop_token_ids: min_tokens must suppress it.
    p = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[first])
    out = llm.generate(["eos"], p)[0].outputs[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_n_samples_share_the_prompt(checkpoint, make_llm):
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    p = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    out = llm.generate(["parallel sampling prompt " * 3], p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)
    one = llm.generate(["parallel sampling prompt " * 3], greedy.clone(n=1))[0].outputs[0]
    many = llm.generate(["parallel sampling prompt " * 3], greedy)[0]
    assert all(c.token_ids == one.token_ids for c in many.outputs)


def test_prompt_logprobs_and_logits_match_transformers(checkpoint, make_llm):
    transformers = pytest.importorskip("transformers")
    path = checkpoint("llama_gqa")
    # A small budget splits the prompt into chunks that attend through the paged cache.
    llm = make_llm(path, dtype="float32", max_num_batched_tokens=16)
    prompt = list(range(40, 90))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # warm the cache
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    out = run_with_prompt_logits(llm.engine, prompt, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    assert out.num_cached_tokens == 0  # prompt logits need every position computed
    assert out.prompt_logits.shape == ref.shape
    torch.testing.assert_close(out.prompt_logits, ref, atol=1e-4, rtol=0)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]] - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert set(ref[pos - 1].topk(3).indices.tolist()) <= set(entry)


@pytest.mark.parametrize("penalised_row", [None, 2])
def test_greedy_rescoring_picks_the_exact_best_of_the_top_candidates(penalised_row):
    """With a rescore function (the float32 LM head beside a bf16 one), each greedy row takes,
    among its RESCORE_TOPK highest logits, the token whose exact logit is highest; a row with
    penalties keeps its plain argmax. Reference: a per-row loop."""
    from kvserve.sample.sampler import RESCORE_TOPK

    g = torch.Generator().manual_seed(3)
    n, v = 6, 50
    logits = torch.randn(n, v, generator=g).to(torch.bfloat16).float()  # ties after rounding
    exact_all = logits + 0.01 * torch.randn(n, v, generator=g)
    params = [SamplingParams(temperature=0, max_tokens=4) for _ in range(n)]
    if penalised_row is not None:
        params[penalised_row] = SamplingParams(temperature=0, max_tokens=4, presence_penalty=0.5)

    def rescore(rows, ids):
        return exact_all[rows[:, None], ids]

    sampler = Sampler(v)
    states = [sampler.add_request(p, [1, 2, 3]) for p in params]
    got = sampler(logits, states, rescore).token_ids
    for i in range(n):
        if i == penalised_row:
            assert got[i] == int(logits[i].argmax())
            continue
        top = logits[i].topk(RESCORE_TOPK).indices.tolist()
        assert got[i] == max(top, key=lambda t: float(exact_all[i, t]))


def test_greedy_rows_take_the_first_of_equal_maxima_as_torch_argmax_does():
    """Greedy without rescoring goes through the native top-1 (float32 rows) or torch.argmax
    (a batch with a NaN): either way each row's token is torch.argmax's, ties going to the
    lowest index, a fully masked row to token 0."""
    g = torch.Generator().manual_seed(5)
    v = 1000
    logits = torch.randn(5, v, generator=g)
    logits[0, [17, 400, 999]] = 9.0  # a three-way tie for the maximum
    logits[1, [998, 999]] = 7.0  # the tie at the end of the row, past the vector body
    logits[2] = float("-inf")  # every token masked
    logits[3, 300:] = float("-inf")
    with_nan = logits.clone()
    with_nan[4, 123] = float("nan")  # torch.argmax takes the NaN: the native path gives way
    sampler = Sampler(v)
    params = SamplingParams(temperature=0, max_tokens=4)
    for batch in (logits, with_nan):
        states = [sampler.add_request(params, [1, 2, 3]) for _ in range(5)]
        got = sampler(batch.clone(), states).token_ids
        assert got == [int(row.argmax()) for row in batch]
        assert got[:3] == [17, 998, 0]
    assert int(with_nan[4].argmax()) == 123
