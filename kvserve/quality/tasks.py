"""Seeded synthetic long-context tasks shared by the reference-model trainer and the quality gate.

Why one module for both: a small model only answers prompts shaped like the ones it was trained
on, so the training script and ``kvserve quality`` must build prompts from the same formats.
Everything here is pure Python (no torch) and deterministic: the same seed, target length and
token counter give the same prompt on any machine with the same Python version.

The haystack is natural text that every machine has offline and that does not depend on the
packages installed in a venv: docstrings of the Python standard library (read with ``ast``, so
nothing is imported or executed), the language reference topics in ``pydoc_data`` and the license
texts in ``/usr/share/common-licenses`` (Debian ``base-files``; skipped if absent). Documents are
split into a training part and a disjoint HELD-OUT part by a hash of their name; the gate measures
perplexity and builds haystacks from the held-out part.

Every prompt generator takes ``count_tokens(text) -> int`` (the gate passes the engine's
tokenizer) and fills the haystack until the whole prompt is ``context_tokens`` long, within
``length_tolerance(context_tokens)``. Prompts end just before the answer; ``answer`` is the exact
greedy continuation expected (e.g. ``" 4831907"``), compared by exact string match.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import re
import sysconfig
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

CountFn = Callable[[str], int]
RenderFn = Callable[[list[dict[str, str]], bool], str]

ADJECTIVES = (
    "amber azure bitter blue brave bright bronze calm clever cold copper crimson curious dark "
    "deep eager early empty fancy fast gentle golden green grey happy hidden hollow icy jolly "
    "keen large lazy little lucky mellow misty modern noble odd olive orange pale plain proud "
    "purple quick quiet rapid red rough round royal rusty salty scarlet sharp shiny silent "
    "silver simple sleepy slow small smooth soft solar steady stormy strong sunny swift tall "
    "tiny velvet violet warm white wild windy wise wooden yellow young"
).split()
NOUNS = (
    "anchor apple arrow badger banner beacon bear bell birch bridge brook canyon castle cedar "
    "cloud comet compass coral crane crystal dagger dolphin dragon eagle falcon feather fern "
    "forest fox garden glacier harbor hawk heron island jaguar kettle lantern lemon lion "
    "maple meadow mirror moon mountain needle oak ocean orchid otter owl panda parrot pebble "
    "pepper pine planet pond rabbit raven river robin rocket saddle salmon shadow shell "
    "spider spruce star stone storm summit sun swan temple thunder tiger tower tulip valley "
    "violin walrus willow wolf"
).split()

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Jinja chat template of the reference model; render_chat() is its pure-Python twin.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render ``messages`` exactly as CHAT_TEMPLATE does (BOS included)."""
    out = BOS + "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
    return out + ("<|assistant|>\n" if add_generation_prompt else "")


# ---- task text formats (the trainer imports these, so train and gate prompts agree) ----
def needle_sentence(key: str, code: str) -> str:
    return f"The pass code for {key} is {code}."


def needle_question(key: str) -> str:
    """Question block; the answer continues with ' <code>'."""
    return f"\nQuestion: What is the pass code for {key}?\nAnswer: The pass code for {key} is"


def var_assign(name: str, value: str) -> str:
    return f"VAR {name} = {value}."


def var_question(name: str) -> str:
    """Answer walks the chain back, one lookup per hop: ' VAR b = VAR a = 58213'."""
    return f"\nQuestion: What is the value of VAR {name}?\nAnswer: VAR {name} ="


def random_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"


def random_code(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))


def distinct_keys(rng: random.Random, n: int, near: str | None = None) -> list[str]:
    """n different keys; with ``near``, half of them share a word with it (hard distractors)."""
    keys: list[str] = []
    while len(keys) < n:
        key = random_key(rng)
        if near is not None and len(keys) % 2 == 0:
            adj, noun = near.split()
            key = (
                f"{adj} {rng.choice(NOUNS)}"
                if rng.random() < 0.5
                else f"{rng.choice(ADJECTIVES)} {noun}"
            )
        if key != near and key not in keys:
            keys.append(key)
    return keys


# ---- haystack corpus ----
def _docstrings(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, nodes))
    return [d for d in docs if d]


_SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "site-packages"}


@functools.lru_cache(maxsize=1)
def corpus_documents() -> tuple[tuple[str, str], ...]:
    """(name, text) of every haystack document, sorted by name."""
    docs: dict[str, str] = {}
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", "__"))
        )
        for fn in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, fn)
            text = "\n\n".join(_docstrings(path))
            if text:
                docs["stdlib:" + os.path.relpath(path, root)] = text
    try:
        from pydoc_data.topics import topics

        docs.update({f"topic:{k}": v for k, v in topics.items()})
    except ImportError:
        pass
    lic = "/usr/share/common-licenses"
    if os.path.isdir(lic):
        for fn in sorted(os.listdir(lic)):
            path = os.path.join(lic, fn)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    docs[f"license:{fn}"] = f.read()
    return tuple(sorted(docs.items()))


def is_heldout(name: str) -> bool:
    """About one document in ten is held out, chosen by a stable hash of its name."""
    return zlib.crc32(name.encode()) % 10 == 0


_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")


def _is_prose(s: str) -> bool:
    if not 20 <= len(s) <= 400 or ">>>" in s or "::" in s or "***" in s or "===" in s:
        return False
    return sum(c.isalpha() or c == " " for c in s) >= 0.8 * len(s)


@functools.lru_cache(maxsize=2)
def haystack_sentences(split: str = "heldout") -> tuple[str, ...]:
    """Prose sentences of one split ('train' or 'heldout'), in document order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    out: list[str] = []
    for name, text in corpus_documents():
        if is_heldout(name) != (split == "heldout"):
            continue
        for para in re.split(r"\n\s*\n", text):
            flat = " ".join(para.split())
            out.extend(s for s in _SENT_SPLIT.split(flat) if _is_prose(s))
    if split == "heldout":  # license versions and topics repeat some sentences: drop those
        seen = set(haystack_sentences("train"))
        out = [s for s in out if s not in seen]
    return tuple(out)


# ---- length fitting ----
def length_tolerance(context_tokens: int) -> int:
    """How far a generated prompt may miss its target length, in tokens."""
    return max(8, context_tokens // 50)


class _Counter:
    """Counts tokens of text pieces joined by spaces, relative to the empty string.

    Byte-level BPE never merges across a space-word boundary, so counts of " piece" add up;
    the final prompt is still measured whole and corrected.
    """

    def __init__(self, count: CountFn):
        self.count, self.base, self.cache = count, count(""), {}

    def __call__(self, text: str) -> int:
        if text not in self.cache:
            self.cache[text] = self.count(text) - self.base
        return self.cache[text]


def _fill(rng: random.Random, budget: int, counter: _Counter, split: str) -> list[str]:
    """Consecutive sentences from a random start, cut at word level to ``budget`` tokens."""
    sents = haystack_sentences(split)
    if not sents:
        raise RuntimeError("no haystack text found (stdlib sources missing?)")
    out: list[str] = []
    i, used = rng.randrange(len(sents)), 0
    while used < budget:
        s = sents[i % len(sents)]
        i += 1
        n = counter(" " + s)
        if used + n <= budget:
            out.append(s)
            used += n
            continue
        words = []
        for w in s.split():
            n = counter(" " + w)
            if used + n > budget:
                break
            words.append(w)
            used += n
        if words:
            out.append(" ".join(words))
        break
    return out


def fit_prompt(
    rng: random.Random,
    context_tokens: int,
    count: CountFn,
    inserts: Sequence[tuple[float, str]],
    make: Callable[[str], str],
    split: str,
) -> str:
    """Haystack of the right size with ``inserts`` ((depth 0..1, sentence)) placed by depth.

    ``make(haystack)`` wraps the haystack into the whole prompt; the haystack budget is the
    target minus what the wrapper and the inserts cost, corrected once by a full re-count.
    """
    counter = _Counter(count)
    overhead = count(make(" ".join(s for _, s in inserts)))
    if overhead > context_tokens:
        raise ValueError(
            f"context_tokens={context_tokens} is below the {overhead} this prompt needs"
        )
    state = rng.getstate()
    budget = context_tokens - overhead
    best: tuple[int, str] | None = None
    for _ in range(6):
        rng.setstate(state)
        sents = _fill(rng, max(budget, 0), counter, split)
        total, cum = sum(counter(" " + s) for s in sents), [0]
        for s in sents:
            cum.append(cum[-1] + counter(" " + s))
        pieces = list(sents)
        for depth, ins in sorted(inserts, key=lambda t: -t[0]):
            target = depth * total
            k = min(range(len(cum)), key=lambda j: abs(cum[j] - target))
            pieces.insert(k, ins)
        text = make(" ".join(pieces))
        miss = context_tokens - count(text)
        if best is None or abs(miss) < best[0]:
            best = (abs(miss), text)
        if abs(miss) <= length_tolerance(context_tokens) // 2:
            break
        budget += miss
    return best[1]


@dataclass(slots=True)
class TaskPrompt:
    """One prompt; ``answer`` is the exact expected greedy continuation.

    ``add_special_tokens`` is False for chat prompts, whose template already starts with BOS.
    """

    kind: str
    prompt: str
    answer: str
    add_special_tokens: bool = True
    meta: dict = field(default_factory=dict)


def _rng(seed: int | random.Random) -> random.Random:
    return seed if isinstance(seed, random.Random) else random.Random(seed)


def needle_prompt(
    seed: int | random.Random,
    context_tokens: int,
    depth_percent: float,
    count_tokens: CountFn,
    split: str = "heldout",
) -> TaskPrompt:
    """One pass-code needle at ``depth_percent`` (0 = first sentence, 100 = just before the
    question) of a natural-text haystack; the prompt ends '...The pass code for <key> is'."""
    if not 0 <= depth_percent <= 100:
        raise ValueError(f"depth_percent must be in [0, 100], got {depth_percent}")
    rng = _rng(seed)
    key, code = random_key(rng), random_code(rng)
    text = fit_prompt(
        rng,
        context_tokens,
        count_tokens,
        [(depth_percent / 100, needle_sentence(key, code))],
        lambda h: h.strip() + needle_question(key),
        split,
    )
    meta = {"key": key, "depth_percent": depth_percent, "context_tokens": context_tokens}
    return TaskPrompt("needle", text, " " + code, meta=meta)


def multi_needle_prompt(
    seed: int | random.Random,
    context_tokens: int,
    count_tokens: CountFn,
    num_needles: int = 4,
    split: str = "heldout",
) -> TaskPrompt:
    """``num_needles`` pass codes at random depths, half of the distractor keys sharing a word
    with the asked key; asks for one of them."""
    rng = _rng(seed)
    key = random_key(rng)
    keys = [key, *distinct_keys(rng, num_needles - 1, near=key)]
    codes = [random_code(rng) for _ in keys]
    inserts = [(rng.random(), needle_sentence(k, c)) for k, c in zip(keys, codes, strict=True)]
    text = fit_prompt(
        rng,
        context_tokens,
        count_tokens,
        inserts,
        lambda h: h.strip() + needle_question(key),
        split,
    )
    meta = {"key": key, "depth": inserts[0][0], "num_needles": num_needles}
    return TaskPrompt("multi_needle", text, " " + codes[0], meta=meta)


def var_chain(rng: random.Random, hops: int, names: list[str]) -> tuple[list[str], str, str]:
    """Assignments 'VAR a = 58213.', 'VAR b = VAR a.', ... in order; returns (sentences, the
    last name, the expected answer ' VAR <prev> = ... = 58213')."""
    value = random_code(rng, 5)
    sents = [var_assign(names[0], value)]
    sents += [var_assign(names[i], "VAR " + names[i - 1]) for i in range(1, hops + 1)]
    answer = "".join(f" VAR {n} =" for n in reversed(names[:hops])) + " " + value
    return sents, names[hops], answer


def variable_tracking_prompt(
    seed: int | random.Random,
    context_tokens: int,
    count_tokens: CountFn,
    hops: int = 2,
    num_chains: int = 2,
    split: str = "heldout",
) -> TaskPrompt:
    """``num_chains`` assignment chains of ``hops`` hops spread in order through the haystack;
    asks the value of the last variable of the first chain."""
    rng = _rng(seed)
    names = rng.sample(NOUNS, (hops + 1) * num_chains)
    inserts, asked, answer = [], "", ""
    for c in range(num_chains):
        sents, last, ans = var_chain(rng, hops, names[c * (hops + 1) : (c + 1) * (hops + 1)])
        depths = sorted(rng.random() for _ in sents)
        inserts += list(zip(depths, sents, strict=True))
        if c == 0:
            asked, answer = last, ans
    text = fit_prompt(
        rng, context_tokens, count_tokens, inserts, lambda h: h.strip() + var_question(asked), split
    )
    # A real model may answer with the value at once or walk only part of the chain: every
    # suffix of the chain that ends in the value is right ("VAR b = VAR a = 58213", "58213").
    parts = answer.split(" =")
    accept = [" =".join(parts[i:]) for i in range(1, len(parts))]
    meta = {"hops": hops, "name": asked, "accept": accept}
    return TaskPrompt("variable_tracking", text, answer, meta=meta)


REMEMBER = "Please remember this. "
PASSAGE = "Read this passage.\n"


def multi_turn_prompt(
    seed: int | random.Random,
    context_tokens: int,
    count_tokens: CountFn,
    num_turns: int = 6,
    render: RenderFn = render_chat,
    split: str = "heldout",
) -> TaskPrompt:
    """A conversation whose first user turn states a pass code; later turns paste passages and
    state distractor codes; the last turn asks for the first code.

    ``render(messages, add_generation_prompt)`` must produce the model's chat template (the
    default is the reference model's). Encode the prompt without adding special tokens.
    """
    rng = _rng(seed)
    key = random_key(rng)
    code = random_code(rng)
    distract = distinct_keys(rng, max(1, num_turns // 3), near=key)
    facts = [(k, random_code(rng)) for k in distract]
    kinds = ["passage"] * (num_turns - 1 - len(facts)) + ["fact"] * len(facts)
    rng.shuffle(kinds)
    marker = "\x00"

    def make(hay: str) -> str:
        chunks = [c.strip() for c in hay.split(marker)]
        msgs = [{"role": "user", "content": REMEMBER + needle_sentence(key, code)}]
        msgs.append({"role": "assistant", "content": "Noted."})
        fi = pi = 0
        for kind in kinds:
            if kind == "fact":
                content = REMEMBER + needle_sentence(*facts[fi])
                fi += 1
            else:
                content = PASSAGE + chunks[min(pi, len(chunks) - 1)]
                pi += 1
            msgs += [
                {"role": "user", "content": content},
                {"role": "assistant", "content": "Noted."},
            ]
        msgs.append({"role": "user", "content": f"What is the pass code for {key}?"})
        return render(msgs, True) + f"The pass code for {key} is"

    # Passage turns share the haystack; markers split it into equal-depth chunks.
    n_pass = kinds.count("passage")
    inserts = [((i + 1) / n_pass, marker) for i in range(n_pass - 1)] if n_pass > 1 else []
    text = fit_prompt(rng, context_tokens, count_tokens, inserts, make, split)
    return TaskPrompt("multi_turn", text, " " + code, False, {"key": key, "turns": num_turns})


def heldout_passages(
    n: int, context_tokens: int, count_tokens: CountFn, seed: int = 0
) -> list[str]:
    """``n`` held-out natural-text passages of about ``context_tokens`` tokens (perplexity)."""
    rng = random.Random(seed)
    return [
        fit_prompt(rng, context_tokens, count_tokens, [], lambda h: h.strip(), "heldout")
        for _ in range(n)
    ]
