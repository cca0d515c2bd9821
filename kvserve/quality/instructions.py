"""Instruction following: prompts whose instruction a program can check, in the spirit of
IFEval (Zhou et al., 2023: "verifiable instructions" such as a case, a length, a keyword).

Why this family: a KV configuration can keep every pass code and still break the form of
what the model writes. Each prompt pastes a held-out text of the target length, asks a plain
question about it and adds one instruction, as IFEval's prompts do (the instruction is part of
the request). All of it is read back from the candidate's cache while the answer is generated.
The instruction comes after the text because small instruct models (SmolLM2-135M) follow
almost no instruction stated before a long text, even with the exact cache, and a family the
baseline fails says nothing about the candidate. The gate compares the share of prompts whose
response follows its instruction, prompt by prompt, under the baseline and the candidate.

Every check reads only the response text (no model, no judgement): the same text gives the
same verdict anywhere. Instructions are picked round-robin by prompt index, so each kind is
equally represented at any suite size.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.quality import tasks as T

KEYWORDS = ("river", "light", "market", "garden", "winter", "bridge", "signal", "paper")
QUESTIONS = (
    "Summarize the text in one sentence.",
    "What is the text about?",
    "Write a short title for the text.",
)
WORD = re.compile(r"[A-Za-z0-9']+")
TITLE = re.compile(r"<<[^<>\n]+>>")
BULLET = re.compile(r"(?m)^[ \t]*\* ")


@dataclass(frozen=True, slots=True)
class Instruction:
    """One kind of checkable instruction: its wording for an argument, the check of a
    response against it, and how a prompt picks the argument."""

    name: str
    text: Callable[[str], str]
    check: Callable[[str, str], bool]
    pick: Callable[[random.Random], str]


def _letters(s: str) -> list[str]:
    return [c for c in s if c.isalpha()]


def _lowercase(text: str, _arg: str) -> bool:
    letters = _letters(text)
    return bool(letters) and not any(c.isupper() for c in letters)


def _title(text: str, _arg: str) -> bool:
    return TITLE.search(text) is not None


def _two_bullets(text: str, _arg: str) -> bool:
    return len(BULLET.findall(text)) == 2


def _starts_with(text: str, word: str) -> bool:
    first = WORD.findall(text.lstrip(" \"'*#"))
    return bool(first) and first[0].lower() == word.lower()


def _includes(text: str, word: str) -> bool:
    return word.lower() in (w.lower() for w in WORD.findall(text))


def _no_commas(text: str, _arg: str) -> bool:
    return bool(text.strip()) and "," not in text


def _max_words(text: str, limit: str) -> bool:
    return 0 < len(WORD.findall(text)) <= int(limit)


def _quoted(text: str, _arg: str) -> bool:
    s = text.strip()
    return len(s) >= 2 and s[0] == '"' and s[-1] == '"'


INSTRUCTIONS: dict[str, Instruction] = {
    i.name: i
    for i in (
        Instruction(
            "starts_with",
            lambda a: f'Start your answer with the word "{a}".',
            _starts_with,
            lambda r: r.choice(("Yes", "Today", "Briefly", "Well")),
        ),
        Instruction(
            "includes_keyword",
            lambda a: f'Use the word "{a}" in your answer.',
            _includes,
            lambda r: r.choice(KEYWORDS),
        ),
        Instruction(
            "title",
            lambda _a: (
                "Give your answer as a title wrapped in double angular brackets, like <<title>>."
            ),
            _title,
            lambda _r: "",
        ),
        Instruction(
            "two_bullets",
            lambda _a: "Answer with exactly two bullet points, each starting with '* '.",
            _two_bullets,
            lambda _r: "",
        ),
        Instruction(
            "no_commas",
            lambda _a: "Do not use any commas in your answer.",
            _no_commas,
            lambda _r: "",
        ),
        Instruction(
            "max_words",
            lambda a: f"Answer in at most {a} words.",
            _max_words,
            lambda r: str(r.choice((10, 15))),
        ),
        Instruction(
            "lowercase",
            lambda _a: "Write your whole answer in lowercase letters: no capital letters at all.",
            _lowercase,
            lambda _r: "",
        ),
        Instruction(
            "quoted",
            lambda _a: "Wrap your entire answer in double quotation marks.",
            _quoted,
            lambda _r: "",
        ),
    )
}
NAMES = tuple(INSTRUCTIONS)


def follows(text: str, meta: dict) -> bool:
    """Whether ``text`` (a response) follows the instruction a prompt's ``meta`` names."""
    return INSTRUCTIONS[meta["instruction"]].check(text, meta["arg"])


def instruction_prompt(
    seed: int,
    index: int,
    context_tokens: int,
    count_tokens: T.CountFn,
    render: T.RenderFn,
    split: str = "heldout",
) -> T.TaskPrompt:
    """One chat prompt of about ``context_tokens`` tokens: a held-out text, a question about
    it and the instruction ``NAMES[index % len(NAMES)]``. Encode without special tokens (the
    chat template adds them). ``answer`` is empty: the check, not a string match, decides."""
    rng = random.Random(seed)
    ins = INSTRUCTIONS[NAMES[index % len(NAMES)]]
    arg = ins.pick(rng)
    question = rng.choice(QUESTIONS)

    def make(hay: str) -> str:
        content = f"Text:\n{hay.strip()}\n\n{question} {ins.text(arg)}"
        return render([{"role": "user", "content": content}], True)

    text = T.fit_prompt(rng, context_tokens, count_tokens, [], make, split)
    meta = {"instruction": ins.name, "arg": arg, "context_tokens": context_tokens}
    return T.TaskPrompt("instruction", text, "", False, meta)
