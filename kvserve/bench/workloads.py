"""Named, seeded workloads and their arrival schedules.

Each workload is a distribution over (prompt, output length, shared prefix) chosen to stress one
side of the KV cache, after the seed's playbook: short vs long prompts, short vs long outputs,
repeated vs unique prefixes, history resent each turn. Everything is drawn from one
``random.Random(seed)``, never from global state, so the same seed gives the same prompts and the
same arrival times on any machine (Python's ``random`` is specified to be reproducible).

Lengths are in tokens as the target's tokenizer counts them when we have it (the in-process
engine, or ``--tokenizer``); otherwise a 4-bytes-per-token estimate is used and the server's
reported ``usage`` gives the true counts. Text is English-like filler from a fixed word list: a
real tokenizer then produces realistic token ids, and shared prefixes are byte-identical, which
is what prefix caching needs.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

CountFn = Callable[[str], int]

_WORDS = (
    "the of and to in is was for on that with as by at from this be are it an or which his "
    "have not they had but were their one all her has been there when who more would will "
    "time new after first also into two can other than its some these only many may most "
    "over such people years city state world between during year under known both system "
    "water while number early later part three found where small large river group family "
    "house school area history music work general public music game team season country "
    "several since each against because local around government national against about "
    "station power light place north south east west high long right found great still "
    "memory cache block token model server request queue latency market price value level"
).split()


def approx_tokens(text: str) -> int:
    """Token estimate without a tokenizer: ~4 bytes per token, as for English BPE."""
    return max(1, round(len(text.encode()) / 4))


@dataclass(slots=True, frozen=True)
class BenchRequest:
    """One request to send. ``prefix_group`` names the shared prefix it starts with (None:
    unique), so reports can split hit rates and latencies by reuse."""

    index: int
    kind: str
    prompt: str
    max_tokens: int
    input_len: int
    prefix_group: str | None = None
    prefix_len: int = 0


@dataclass(slots=True)
class WorkloadSpec:
    """Knobs of a workload; ``None`` means the named workload's default. ``length_scale``
    multiplies every length (a CPU smoke test and a GPU run share the same shapes)."""

    name: str = "mixed"
    num_prompts: int = 64
    seed: int = 0
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    prefix_len: int | None = None
    num_prefixes: int | None = None
    prefix_share: float | None = None
    turns: int | None = None
    max_active_conversations: int = 1
    length_scale: float = 1.0
    max_model_len: int | None = None
    mix: dict[str, float] = field(default_factory=dict)


# name -> defaults. input_len is the unique part of the prompt; prefix_len the shared part.
KINDS: dict[str, dict[str, float]] = {
    "chat": dict(input_len=160, output_len=96, range_ratio=0.5, prefix_len=48, num_prefixes=1,
                 prefix_share=1.0, turns=1),
    "rag": dict(input_len=32, output_len=48, range_ratio=0.5, prefix_len=384, num_prefixes=4,
                prefix_share=0.9, turns=1),
    "multi-turn": dict(input_len=48, output_len=48, range_ratio=0.5, prefix_len=32,
                       num_prefixes=1, prefix_share=1.0, turns=4),
    "long-doc": dict(input_len=1536, output_len=32, range_ratio=0.25, prefix_len=0,
                     num_prefixes=0, prefix_share=0.0, turns=1),
    "prefill-heavy": dict(input_len=768, output_len=8, range_ratio=0.25, prefix_len=0,
                          num_prefixes=0, prefix_share=0.0, turns=1),
    "decode-heavy": dict(input_len=32, output_len=384, range_ratio=0.25, prefix_len=0,
                         num_prefixes=0, prefix_share=0.0, turns=1),
}  # fmt: skip
DEFAULT_MIX = {
    "chat": 0.3, "rag": 0.25, "multi-turn": 0.15, "long-doc": 0.1,
    "prefill-heavy": 0.1, "decode-heavy": 0.1,
}  # fmt: skip
WORKLOADS = (*KINDS, "mixed")


_CAPITALIZED = tuple(w.capitalize() for w in _WORDS)
_STOCK_RANDBELOW = random.Random._randbelow_with_getrandbits  # what choice() uses


class TextMaker:
    """Filler text of a target token length under a token counter."""

    def __init__(self, count_tokens: CountFn | None = None) -> None:
        self.count = count_tokens or approx_tokens
        probe = " ".join(random.Random(1234).choice(_WORDS) for _ in range(400))
        self.tokens_per_word = max(0.05, self.count(probe) / 400)

    def words(self, rng: random.Random, n_words: int) -> str:
        """``n_words`` seeded words in sentences. The draws are exactly ``rng.choice(words)``
        then ``rng.random()`` per word (what ``choice`` calls, without its per-call overhead:
        a 100,000-request workload draws ~30 M words), so a seed's text never changes."""
        return " ".join(self._draw(rng, max(1, n_words)))

    @staticmethod
    def _draw(rng: random.Random, n: int, capital: bool = True, keep: bool = True) -> list[str]:
        """The next ``n`` words (``capital``: the first starts a sentence), or with ``keep``
        False only their draws (the generator left where making them would leave it).
        ``choice`` draws an index as ``Random._randbelow_with_getrandbits`` does, inlined
        here: ``getrandbits(k)`` for the bit length k of the word count until it is below
        it (a subclass with its own generator takes the method)."""
        rnd, n_all = rng.random, len(_WORDS)
        getrandbits, k = rng.getrandbits, n_all.bit_length()
        below = None if type(rng)._randbelow is _STOCK_RANDBELOW else rng._randbelow
        out: list[str] = []
        for _ in range(n):
            if below is None:
                i = getrandbits(k)
                while i >= n_all:
                    i = getrandbits(k)
            else:
                i = below(n_all)
            if keep:
                w = _CAPITALIZED[i] if capital else _WORDS[i]
                capital = rnd() < 0.08
                out.append(w + "." if capital else w)
            else:
                rnd()
        return out

    def text(self, rng: random.Random, n_tokens: int) -> str:
        """About ``n_tokens`` tokens; one correction pass after counting keeps it close
        without re-tokenizing per word. The corrected text is ``words`` of the corrected
        count from the same state, made from the first pass: its first words are the same
        draws (kept, the generator's draws replayed without the strings), or it continues
        them."""
        n = max(1, round(n_tokens / self.tokens_per_word))
        state = rng.getstate()
        out = self._draw(rng, n)
        text = " ".join(out)
        err = n_tokens - self.count(text)
        if abs(err) > max(2, 0.03 * n_tokens):
            n2 = max(1, n + round(err / self.tokens_per_word))
            if n2 <= n:
                rng.setstate(state)
                self._draw(rng, n2, keep=False)
                out = out[:n2]
            else:
                out += self._draw(rng, n2 - n, capital=out[-1].endswith("."))
            text = " ".join(out)
        return text


def _param(spec: WorkloadSpec, kind: str, name: str) -> float:
    v = getattr(spec, name)
    return KINDS[kind][name] if v is None else v


def _length(rng: random.Random, mean: float, ratio: float, scale: float) -> int:
    """Uniform in mean x [1 - ratio, 1 + ratio], scaled, at least 1 (vLLM's random dataset)."""
    lo, hi = mean * (1 - ratio) * scale, mean * (1 + ratio) * scale
    return max(1, round(rng.uniform(lo, hi)))


def _make_kind(
    kind: str, n: int, spec: WorkloadSpec, rng: random.Random, tm: TextMaker
) -> Iterator[BenchRequest]:
    """``n`` requests of one kind, each made when it is taken. Shared prefixes are built
    first, so request i of a workload does not depend on how many requests come after it."""
    sc = spec.length_scale
    ratio = _param(spec, kind, "range_ratio")
    in_len, out_len = _param(spec, kind, "input_len"), _param(spec, kind, "output_len")
    p_len = round(_param(spec, kind, "prefix_len") * sc)
    n_pref = int(_param(spec, kind, "num_prefixes"))
    share = _param(spec, kind, "prefix_share")
    prefixes = [tm.text(rng, p_len) for _ in range(n_pref)] if p_len and n_pref else []
    if kind == "multi-turn":
        yield from _conversations(n, spec, rng, tm, prefixes, p_len)
        return
    for i in range(n):
        pre, group = "", None
        if prefixes and rng.random() < share:
            j = rng.randrange(len(prefixes))
            pre, group = prefixes[j], f"{kind}/{j}"
        elif p_len:
            pre = tm.text(rng, p_len)  # a unique prefix of the same length
        body = tm.text(rng, _length(rng, in_len, ratio, sc))
        if kind == "rag":
            prompt = f"Document: {pre}\nQuestion: {body}\nAnswer:" if pre else body
        elif kind == "chat":
            prompt = f"{pre}\nUser: {body}\nAssistant:" if pre else body
        else:
            prompt = f"{pre}\n{body}" if pre else body
        o = _length(rng, out_len, ratio, sc)
        yield BenchRequest(i, kind, prompt, o, tm.count(prompt), group,
                           tm.count(pre) if group else 0)  # fmt: skip


def _conversations(
    n: int,
    spec: WorkloadSpec,
    rng: random.Random,
    tm: TextMaker,
    prefixes: list[str],
    p_len: int,
) -> Iterator[BenchRequest]:
    """The multi-turn kind's ``n`` requests: conversations made one after another, sent
    in :func:`_interleave`'s order, one group of ``max_active_conversations`` at a time."""
    kind, sc = "multi-turn", spec.length_scale
    ratio = _param(spec, kind, "range_ratio")
    in_len, out_len = _param(spec, kind, "input_len"), _param(spec, kind, "output_len")
    turns = max(1, int(_param(spec, kind, "turns")))
    made = num_convs = 0
    while made < n:
        convs: list[list[BenchRequest]] = []
        while made < n and len(convs) < spec.max_active_conversations:
            history = prefixes[0] if prefixes else tm.text(rng, max(1, p_len))
            conv = []
            for t in range(min(turns, n - made)):
                # Turn 0 shares the system prompt; later turns share their whole history.
                group = (
                    f"multi-turn/{num_convs}" if t else ("multi-turn/system" if prefixes else None)
                )
                user = tm.text(rng, _length(rng, in_len, ratio, sc))
                prompt = f"{history}\nUser: {user}\nAssistant:"
                o = _length(rng, out_len, ratio, sc)
                conv.append(
                    BenchRequest(0, kind, prompt, o, tm.count(prompt), group,
                                 tm.count(history) if group else 0)
                )  # fmt: skip
                # The next turn resends everything, with a synthetic reply of this turn's length.
                history = f"{prompt} {tm.text(rng, o)}"
            convs.append(conv)
            num_convs += 1
            made += len(conv)
        yield from _interleave(convs, len(convs))


def _interleave(convs: list[list[BenchRequest]], active: int) -> list[BenchRequest]:
    """Send order of conversations taking turns ``active`` at a time: every conversation of a
    group sends turn t before any sends turn t + 1 (vLLM's ``--max-active-conversations``,
    LMCache's users of a multi-round QA), so the histories of the group compete for the KV
    pool between turns, as many users chatting at once do. 1: each conversation to its end
    before the next starts. The texts do not depend on ``active``, only the order."""
    out: list[BenchRequest] = []
    for g in range(0, len(convs), active):
        group = convs[g : g + active]
        for t in range(max(len(c) for c in group)):
            out.extend(c[t] for c in group if t < len(c))
    return out


def _fit(reqs: Iterable[BenchRequest], max_model_len: int | None) -> Iterator[BenchRequest]:
    """Cap output lengths so prompt + output fits the target's context (with 1 token of
    slack for the counter's error); prompts are never cut, since that would break prefixes."""
    if not max_model_len:
        yield from reqs
        return
    for r in reqs:
        room = max_model_len - r.input_len - 1
        if room < 1:
            raise ValueError(
                f"max_model_len: a {r.kind} prompt of {r.input_len} tokens leaves no room for "
                f"output in {max_model_len}; lower --length-scale or --input-len"
            )
        yield replace(r, max_tokens=min(r.max_tokens, room))


def make_workload(spec: WorkloadSpec, count_tokens: CountFn | None = None) -> list[BenchRequest]:
    """The requests of a named workload (or a JSONL file), in send order, indexed 0..n-1."""
    return list(iter_workload(spec, count_tokens))


def iter_workload(
    spec: WorkloadSpec, count_tokens: CountFn | None = None
) -> Iterator[BenchRequest]:
    """:func:`make_workload`'s requests one at a time, each made when it is taken (a long
    trace's consumer can start on the first while the rest are drawn). The spec is checked
    here, before the first; a prompt too long for ``max_model_len`` raises when it is
    reached."""
    check_workload_spec(spec)
    tm = TextMaker(count_tokens)
    rng = random.Random(spec.seed)
    name = spec.name
    reqs: Iterable[BenchRequest]
    if name.endswith(".jsonl") or Path(name).is_file():
        reqs = load_jsonl(Path(name), spec, rng, tm)
    elif name == "mixed":
        mix = spec.mix or DEFAULT_MIX
        kinds = rng.choices(list(mix), weights=list(mix.values()), k=spec.num_prompts)
        # Each kind draws from its own generator, so taking them interleaved draws the same.
        per_kind = {
            k: _make_kind(k, kinds.count(k), spec, random.Random(rng.random()), tm)
            for k in mix
            if k in kinds
        }
        reqs = (next(per_kind[k]) for k in kinds)
    else:
        reqs = _make_kind(name, spec.num_prompts, spec, rng, tm)
    return (replace(r, index=i) for i, r in enumerate(_fit(reqs, spec.max_model_len)))


def check_workload_spec(spec: WorkloadSpec) -> None:
    """Raise a ValueError (FileNotFoundError for a missing trace) naming the field of
    ``spec`` that no workload can be made from."""
    if spec.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {spec.num_prompts}")
    if spec.max_active_conversations < 1:
        raise ValueError(
            f"max_active_conversations: must be >= 1, got {spec.max_active_conversations}"
        )
    name = spec.name
    if name.endswith(".jsonl") or Path(name).is_file():
        if not Path(name).is_file():
            raise FileNotFoundError(f"workload: file not found: {name}")
    elif name == "mixed":
        bad = set(spec.mix or DEFAULT_MIX) - set(KINDS)
        if bad:
            raise ValueError(f"mix: unknown kinds {sorted(bad)}; known: {', '.join(KINDS)}")
    elif name not in KINDS:
        raise ValueError(
            f"workload: unknown {name!r}; choose one of {', '.join(WORKLOADS)} or a .jsonl file"
        )


def load_jsonl(
    path: Path, spec: WorkloadSpec, rng: random.Random, tm: TextMaker
) -> list[BenchRequest]:
    """One request per line: ``{"prompt": str, "max_tokens": int}`` or ``{"input_len": int,
    "output_len": int}`` (filler text of that length); optional ``prefix_group``. Lines cycle
    when ``num_prompts`` exceeds them, so a small trace can drive a long run."""
    if not path.is_file():
        raise FileNotFoundError(f"workload: file not found: {path}")
    rows = []
    for ln, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"workload: {path}:{ln}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or ("prompt" not in row and "input_len" not in row):
            raise ValueError(f"workload: {path}:{ln}: needs 'prompt' or 'input_len'")
        rows.append(row)
    if not rows:
        raise ValueError(f"workload: {path} holds no requests")
    default_out = spec.output_len or 64
    out = []
    for i in range(spec.num_prompts):
        row = rows[i % len(rows)]
        prompt = row.get("prompt") or tm.text(rng, int(row["input_len"]))
        max_tokens = int(row.get("max_tokens") or row.get("output_len") or default_out)
        out.append(
            BenchRequest(i, "jsonl", str(prompt), max_tokens, tm.count(str(prompt)),
                         row.get("prefix_group"))
        )  # fmt: skip
    return out


def arrival_times(
    n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send offsets in seconds for an open loop: gaps drawn from a gamma distribution with
    mean 1/rate and shape ``burstiness`` (1 = Poisson; < 1 burstier, > 1 smoother), as vLLM's
    benchmark does. An infinite rate sends everything at once. The schedule has its own
    random stream, so changing the workload does not move the arrivals."""
    if burstiness <= 0:
        raise ValueError(f"burstiness: must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request_rate: must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(f"arrivals/{seed}")
    scale = 1.0 / (request_rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out
