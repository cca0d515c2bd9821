"""Logits processors: each against a naive per-row reference written here in plain Python, their
fixed order, the greedy rescoring under masks and biases, the grammar hook, validation, and
end to end through ``LLM`` on the bundled model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve import SamplingParams
from kvserve.sample.builtin_processors import build_logits_processors
from kvserve.sample.logits_processors import LogitsProcessor, LogitsProcessors
from kvserve.sample.sampler import RESCORE_TOPK, Sampler, SamplingState
from kvserve.sample.token_bitmask import (
    TokenBitmaskLogitsProcessor,
    TokenBitmaskState,
    token_ids_to_bitmask,
    unpack_bitmask,
)
from kvserve.sched.request import InvalidRequestError

INF = float("inf")


def naive(row: list[float], p: SamplingParams, prompt, output, eos) -> list[float]:
    """One row through the documented order, token by token: penalties, min_tokens,
    logit_bias, allowed_token_ids."""
    x = list(row)
    v = len(x)
    for t in range(v):
        count = output.count(t)
        if p.repetition_penalty != 1.0 and (t in prompt or count):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if len(output) < p.min_tokens:
        for t in set(eos if not p.ignore_eos else ()) | set(p.stop_token_ids or ()):
            x[t] = -INF
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if p.allowed_token_ids is not None:
        x = [x[t] if t in p.allowed_token_ids else -INF for t in range(v)]
    return x


def processed(processors: LogitsProcessors, logits: torch.Tensor, states) -> torch.Tensor:
    plan = processors.plan(states)
    if plan is None:
        return logits
    return plan.apply(logits.clone(), argmax_invariant=False)


V = 40


def random_case(rng: random.Random) -> tuple[SamplingParams, list[int], list[int], tuple]:
    kw = {}
    if rng.random() < 0.5:
        kw["repetition_penalty"] = rng.choice([1.0, 0.7, 1.8])
        kw["frequency_penalty"] = rng.choice([0.0, 0.4, -1.1])
        kw["presence_penalty"] = rng.choice([0.0, 1.5, -0.3])
    if rng.random() < 0.5:
        kw["min_tokens"] = rng.randint(1, 6)
        kw["stop_token_ids"] = rng.sample(range(V), 2)
    if rng.random() < 0.5:
        kw["logit_bias"] = {t: rng.uniform(-100, 100) for t in rng.sample(range(V), 5)}
    if rng.random() < 0.5:
        kw["allowed_token_ids"] = rng.sample(range(V), rng.randint(1, 12))
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 10))]
    output = [rng.randrange(V) for _ in range(rng.randint(0, 8))]
    return SamplingParams(temperature=0, **kw), prompt, output, (rng.randrange(V),)


@pytest.mark.parametrize("seed", range(6))
def test_processors_in_order_match_a_naive_reference(seed):
    """Random batches, every processor mix (none, one, several per row): the processed
    logits equal the per-row reference."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cases = [random_case(rng) for _ in range(9)]
    logits = torch.randn(len(cases), V) * 3
    procs = build_logits_processors(V)
    states = [SamplingState(p, prompt, out, eos, procs) for p, prompt, out, eos in cases]
    got = processed(procs, logits, states)
    want = torch.tensor([naive(logits[i].tolist(), *c) for i, c in enumerate(cases)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=-0.5),
        SamplingParams(min_tokens=5, stop_token_ids=[3, 9]),
        SamplingParams(logit_bias={0: 100, 7: -100, 8: 2.5}),
        SamplingParams(allowed_token_ids=[1, 31, 32, 39]),  # bits 31 and 32: across a word
    ],
    ids=["penalties", "min_tokens", "logit_bias", "allowed_token_ids"],
)
def test_each_processor_alone_touches_only_its_rows(params):
    torch.manual_seed(1)
    prompt, out, eos = [2, 3, 3, 17], [3, 5, 5], (9,)
    plain = SamplingParams()
    logits = torch.randn(4, V)
    procs = build_logits_processors(V)
    rows = [plain, params, plain, params]
    states = [SamplingState(p, prompt, list(out), eos, procs) for p in rows]
    got = processed(procs, logits, states)
    for i, p in enumerate(rows):
        want = torch.tensor(naive(logits[i].tolist(), p, prompt, out, eos))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[1], logits[1])  # the case does change its rows


def test_no_processor_no_work():
    """Plain greedy, temperature, top-k/top-p/min-p and seeded rows use no processor: the
    sampler makes no plan (no copy of the logits, no pass over them)."""
    procs = build_logits_processors(V)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
              min_p=0.1, seed=3), SamplingParams(min_tokens=2, ignore_eos=True),
              SamplingParams(logit_bias={})]  # fmt: skip
    states = [SamplingState(p, [1, 2], [], (2,), procs) for p in params]
    assert all(s.logits_states == () for s in states)
    assert procs.plan(states) is None


def test_min_tokens_stops_masking_once_reached():
    procs = build_logits_processors(V)
    p = SamplingParams(temperature=0, min_tokens=2)
    state = SamplingState(p, [1], [], (5,), procs)
    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0
    sampler = Sampler(V, logits_processors=procs)
    tokens = []
    for _ in range(3):
        tok = sampler(logits, [state]).token_ids[0]
        state.append_token(tok)
        tokens.append(tok)
    assert tokens[0] != 5 and tokens[1] != 5 and tokens[2] == 5


def test_order_bias_before_top_k():
    """logit_bias applies before top-k: +10 on the lowest token makes it the only one top_k=1
    keeps. In the other order (top-k first, then the bias) token 0 would be the only one."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    p = SamplingParams(temperature=1.0, top_k=1, logit_bias={3: 10.0})
    sampler = Sampler(4, seed=1)
    states = [sampler.add_request(p, [0]) for _ in range(200)]
    assert set(sampler(logits, states).token_ids) == {3}
    # the other order, by hand: keep the top-1 of the raw row, then add the bias
    row = logits[0].tolist()
    kept = [x if i == row.index(max(row)) else -INF for i, x in enumerate(row)]
    biased = [x + (10.0 if i == 3 else 0.0) for i, x in enumerate(kept)]
    assert biased.index(max(biased)) == 0


def test_order_penalty_before_bias():
    """Repetition penalty, then the bias: (x / r) + b, not (x + b) / r."""
    x, r, b = 4.0, 2.0, 3.0
    p = SamplingParams(temperature=0, repetition_penalty=r, logit_bias={1: b})
    procs = build_logits_processors(3)
    state = SamplingState(p, [1], [], (), procs)
    got = processed(procs, torch.tensor([[0.0, x, 0.0]]), [state])
    assert got[0, 1].item() == pytest.approx(x / r + b) and x / r + b != (x + b) / r


def test_allowed_tokens_mask_then_bias_cannot_revive():
    """A bias on a token outside allowed_token_ids leaves it masked."""
    p = SamplingParams(temperature=0, allowed_token_ids=[1, 2], logit_bias={0: 100})
    sampler = Sampler(4)
    logits = torch.tensor([[5.0, 0.0, 1.0, 9.0]])
    assert sampler(logits, [sampler.add_request(p, [0])]).token_ids == [2]


def test_sampled_rows_draw_only_allowed_tokens():
    torch.manual_seed(0)
    sampler = Sampler(V, seed=4)
    allowed = [3, 11, 29]
    p = SamplingParams(temperature=1.5, allowed_token_ids=allowed)
    plain = SamplingParams(temperature=1.5)
    states = [sampler.add_request(p if i % 2 else plain, [0]) for i in range(400)]
    out = sampler(torch.randn(400, V), states).token_ids
    assert set(out[1::2]) == set(allowed)
    assert len(set(out[::2])) > 10  # the neighbours are not restricted


# -- bitmasks -------------------------------------------------------------------------------


def test_bitmask_layout_is_the_grammar_libraries():
    """Bit t % 32 of word t // 32 (two's complement int32), as xgrammar and llguidance fill."""
    vocab = 70
    ids = [0, 5, 31, 32, 63, 64, 69]
    bits = token_ids_to_bitmask(ids, vocab)
    assert bits.dtype == torch.int32 and bits.shape == (3,)
    for t in range(vocab):
        word = int(bits[t // 32]) & 0xFFFFFFFF
        assert bool(word >> (t % 32) & 1) == (t in ids)
    allowed = unpack_bitmask(bits[None], vocab)[0]
    assert allowed.nonzero().flatten().tolist() == ids


class EvenOdd(TokenBitmaskState):
    """A toy grammar: tokens alternate even, odd, even, ... from the first output token."""

    __slots__ = ("seen",)

    def __init__(self, output: list[int]) -> None:
        self.seen = list(output)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        parity = len(self.seen) % 2
        flags = [(t % 2 == parity) for t in range(bitmask.shape[1] * 32)]
        word = [
            sum(1 << b for b in range(32) if flags[w * 32 + b]) for w in range(len(flags) // 32)
        ]
        bitmask[row] &= torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in word],
                                     dtype=torch.int32)  # fmt: skip

    def accept_token(self, token: int) -> None:
        self.seen.append(token)


class EvenOddProcessor(TokenBitmaskLogitsProcessor[EvenOdd]):
    def new_state(self, request):  # noqa: ANN001, ANN201
        return EvenOdd(request.output_token_ids) if request.sampling_params.n == 2 else None


def test_grammar_hook_advances_with_each_sampled_token():
    """A processor in the mask stage whose per-request state fills its bitmask row each step
    and sees each sampled token: the way a grammar plugs in. It composes with
    allowed_token_ids (both masks hold) and leaves other rows alone."""
    procs = build_logits_processors(V)
    procs = LogitsProcessors([*procs.processors, EvenOddProcessor(V)])
    sampler = Sampler(V, seed=2, logits_processors=procs)
    allowed = list(range(0, V, 3))  # 0, 3, 6, ...: both parities
    grammar = SamplingParams(n=2, temperature=0.8)
    both = SamplingParams(n=2, temperature=0, allowed_token_ids=allowed)
    states = [sampler.add_request(p, [1]) for p in (grammar, SamplingParams(), both)]
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        out = sampler(torch.randn(3, V, generator=g), states).token_ids
        for st, tok in zip(states, out, strict=True):
            st.append_token(tok)
        assert out[0] % 2 == step % 2 and out[2] % 2 == step % 2 and out[2] in allowed
    assert states[0].logits_states[0][1].seen == states[0].output_token_ids
    assert len({t % 2 for t in states[1].output_token_ids}) == 2  # unconstrained


class Recorder(LogitsProcessor):
    """Argmax-invariant: keeps the row's best token and the next (the argmax survives)."""

    argmax_invariant = True

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.seen: list[torch.Tensor] = []

    def new_state(self, request):  # noqa: ANN001, ANN201
        from kvserve.sample.logits_processors import RequestLogitsState

        return RequestLogitsState()

    def apply(self, logits, rows, states):  # noqa: ANN001, ANN201
        self.seen.append(logits[rows].clone())
        cut = logits[rows].topk(2, dim=-1).values[:, -1:]
        logits[rows] = logits[rows].masked_fill(logits[rows] < cut, -INF)
        return logits


def test_argmax_invariant_processors_skip_greedy_batches():
    rec = Recorder(5)
    sampler = Sampler(5, seed=0, logits_processors=LogitsProcessors([rec]))
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    greedy = sampler.add_request(SamplingParams(temperature=0), [0])
    assert sampler(logits, [greedy]).token_ids == [1] and rec.seen == []
    hot = [sampler.add_request(SamplingParams(temperature=2.0), [0]) for _ in range(300)]
    out = sampler(logits.repeat(300, 1), hot).token_ids
    assert set(out) == {1, 2}  # only the two the processor kept
    torch.testing.assert_close(rec.seen[0][0], logits[0] / 2.0)  # after temperature


# -- greedy rescoring ---------------------------------------------------------------------


def _rescore_ref(logits, exact, params, v):
    """Per row: the argmax over the top RESCORE_TOPK processed logits of (exact logit + the
    row's bias), masked tokens excluded; the processed argmax for a penalised row."""
    procs = build_logits_processors(v)
    states = [SamplingState(p, [0], [], (), procs) for p in params]
    proc = processed(procs, logits, states)
    out = []
    for i, p in enumerate(params):
        if p.uses_penalties:
            out.append(int(proc[i].argmax()))
            continue
        top = proc[i].topk(RESCORE_TOPK).indices.tolist()
        allowed = set(p.allowed_token_ids) if p.allowed_token_ids is not None else set(range(v))
        bias = p.logit_bias or {}
        score = {t: float(exact[i, t]) + bias.get(t, 0.0) for t in top if t in allowed}
        out.append(max(score, key=score.get))
    return out


def _rescore_fn(exact):
    return lambda rows, ids: exact[rows[:, None], ids]


def test_rescore_keeps_a_bias_that_flips_a_near_tie():
    """Tokens 5 and 9 are near-tied (5 ahead in both the rounded and the exact logits); a
    bias of 0.05 on 9 puts it ahead. The rescore must add the bias to 9's exact logit, so 9
    wins; rescoring with the bare exact logits would flip it back to 5."""
    v = 16
    logits = torch.full((1, v), -2.0)
    logits[0, 5], logits[0, 9] = 1.0, 0.99
    exact = logits.clone()
    exact[0, 5], exact[0, 9] = 1.004, 0.996
    biased = SamplingParams(temperature=0, logit_bias={9: 0.05})
    sampler = Sampler(v)
    rescore = _rescore_fn(exact)
    assert sampler(logits, [sampler.add_request(SamplingParams(temperature=0), [0])],
                   rescore).token_ids == [5]  # fmt: skip
    assert sampler(logits, [sampler.add_request(biased, [0])], rescore).token_ids == [9]
    # a bias that puts 9 ahead in the rounded logits but not in the exact ones: the rescore
    # settles the near-tie on exact + bias (0.990 + 0.0125 < 1.004)
    exact[0, 9] = 0.990
    small = SamplingParams(temperature=0, logit_bias={9: 0.0125})
    assert sampler(logits, [sampler.add_request(small, [0])], rescore).token_ids == [5]
    assert sampler(logits, [sampler.add_request(small, [0])]).token_ids == [9]  # no rescore


def test_rescore_never_picks_a_forbidden_top_candidate():
    """The top token is not allowed (and has the highest exact logit too): never chosen."""
    v = 16
    logits = torch.linspace(-1, 1, v)[None].clone()
    exact = logits + 0.001
    exact[0, v - 1] = 5.0
    p = SamplingParams(temperature=0, allowed_token_ids=list(range(v - 1)))
    sampler = Sampler(v)
    assert sampler(logits, [sampler.add_request(p, [0])], _rescore_fn(exact)).token_ids == [v - 2]
    m = SamplingParams(temperature=0, min_tokens=1)  # EOS masked the same way
    state = sampler.add_request(m, [0], [], (v - 1,))
    assert sampler(logits, [state], _rescore_fn(exact)).token_ids == [v - 2]


@pytest.mark.parametrize("seed", range(4))
def test_rescore_with_processors_against_reference(seed):
    """Random near-tied batches, greedy rows with and without biases, masks and penalties,
    and a sampled row (the rescore then takes the subset path)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    n, v = 8, 48
    logits = torch.randn(n, v, generator=g).to(torch.bfloat16).float()  # ties after rounding
    exact = logits + 0.01 * torch.randn(n, v, generator=g)
    params = []
    for i in range(n):
        kw = {}
        if i % 4 == 1:
            top = logits[i].topk(3).indices.tolist()
            kw["logit_bias"] = {top[2]: rng.uniform(0.0, 0.05), top[0]: -rng.uniform(0, 0.02)}
        if i % 4 == 2:
            kw["allowed_token_ids"] = [t for t in range(v) if t != int(logits[i].argmax())]
        if i == 3:
            kw["presence_penalty"] = 0.5
        params.append(SamplingParams(temperature=0, **kw))
    sampler = Sampler(v, seed=seed)
    states = [sampler.add_request(p, [0]) for p in params]
    got = sampler(logits, states, _rescore_fn(exact)).token_ids
    assert got == _rescore_ref(logits, exact, params, v)
    # the same greedy rows beside a sampled row: the rescore's subset path
    hot = sampler.add_request(SamplingParams(temperature=1.0), [0])
    mixed = sampler(
        torch.cat([logits, torch.randn(1, v)]),
        [*states, hot],
        lambda rows, ids: torch.cat([exact, torch.zeros(1, v)])[rows[:, None], ids],
    )
    assert mixed.token_ids[:n] == got  # fmt: skip


# -- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: -101}), "logit_bias"),
        (dict(logit_bias={5: math.nan}), "logit_bias"),
        (dict(logit_bias={5: math.inf}), "logit_bias"),
        (dict(logit_bias={5: True}), "logit_bias"),
        (dict(logit_bias={5: "1"}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={"5": 1}), "logit_bias"),
        (dict(logit_bias={True: 1}), "logit_bias"),
        (dict(logit_bias=[5, 1]), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(allowed_token_ids=["1"]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
        (dict(allowed_token_ids=5), "allowed_token_ids"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kw)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


def test_bias_range_ends_are_accepted():
    p = SamplingParams(logit_bias={0: -100, 1: 100.0, 2: 0})
    assert p.logit_bias == {0: -100, 1: 100.0, 2: 0}


# -- end to end on the bundled model ------------------------------------------------------


PROMPT = "The pass code for the vault is"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_greedy_with_allowed_token_ids_generates_only_those(make_llm):
    bundled = make_llm("kvserve-ref", max_model_len=128, dtype="float32")
    plain = bundled.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    allowed = [t for t in range(100, 4096, 97) if t not in plain]
    out = bundled.generate([PROMPT], GREEDY.clone(allowed_token_ids=allowed))[0].outputs[0]
    assert out.token_ids and set(out.token_ids) <= set(allowed)
    hot = GREEDY.clone(temperature=1.0, seed=1, n=3, allowed_token_ids=allowed)
    for c in bundled.generate([PROMPT], hot)[0].outputs:
        assert set(c.token_ids) <= set(allowed)


def test_logit_bias_forces_and_forbids(make_llm):
    bundled = make_llm("kvserve-ref", max_model_len=128, dtype="float32")
    plain = bundled.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    forced = next(t for t in range(300, 4096) if t not in plain)
    out = bundled.generate([PROMPT], GREEDY.clone(logit_bias={forced: 100}))[0].outputs[0]
    assert out.token_ids == [forced] * 10
    first = plain[0]
    out = bundled.generate([PROMPT], GREEDY.clone(logit_bias={first: -100}))[0].outputs[0]
    assert first not in out.token_ids and out.token_ids[0] != plain[0]


def test_bf16_greedy_rescoring_respects_masks(make_llm):
    """A bfloat16 model, whose greedy rows are rescored on the float32 LM head the loader
    keeps beside its bf16 one: the allowed ids hold through the rescore."""
    llm = make_llm("kvserve-ref", max_model_len=128, dtype="bfloat16")
    plain = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    allowed = sorted(set(range(1, 4096, 5)) - set(plain))
    out = llm.generate([PROMPT], GREEDY.clone(allowed_token_ids=allowed))[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_token_ids_outside_the_vocabulary_are_refused(make_llm):
    bundled = make_llm("kvserve-ref", max_model_len=128, dtype="float32")
    for kw, field in ((dict(logit_bias={4096: 1.0}), "logit_bias"),
                      (dict(allowed_token_ids=[1, 5000]), "allowed_token_ids")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as err:
            bundled.generate([PROMPT], GREEDY.clone(**kw))
        assert err.value.field == field and "[0, 4096)" in str(err.value)
    assert len(bundled.generate([PROMPT], GREEDY)[0].outputs[0].token_ids) == 10
