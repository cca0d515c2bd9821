"""The gate's prompt set: the generators of :mod:`kvserve.quality.tasks`, rendered through the
gated model's own tokenizer (and chat template), so any checkpoint the engine loads can be gated.

Why token ids and not text: the baseline and the candidate must see byte-identical inputs, and
the generators fit each prompt to a target length measured in *this* tokenizer's tokens. Every
prompt gets a seed derived from (suite seed, task, length, depth, index), so one cell of the
grid never changes when another is added or removed.

The needle grid puts its prompts round-robin over (context length, depth) cells, half of them
at depths 0-10 % ("important information appears early") and half deeper, so every cell keeps
a count and the early band is a judged group of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from kvserve.config import ConfigError
from kvserve.quality import instructions as I
from kvserve.quality import tasks as T

EARLY_DEPTH = 10.0  # depth band reported on its own: "important information appears early"
# The suite's tasks, as --tasks names them: the generation groups and the held-out passages
# (perplexity, agreement and KL read them)
TASKS = ("needle", "multi_needle", "variable_tracking", "multi_turn", "instruction", "passages")
PASSAGE_METRICS = ("perplexity", "teacher_forced_agreement", "mean_kl")
# --full's groups, in multiples of its ``prompts``: the groups whose answers flip both ways
# under a format that loses little (a free-form instruction answer changes with any token, a
# multi-turn or multi-needle answer with a few) need several times the prompts to decide; the
# rest do not
FULL_WEIGHTS = (("multi_needle", 3), ("multi_turn", 2), ("instruction", 6))


def metric_task(key: str) -> str:
    """The task (as --tasks names it) that a report row's metric ``key`` is read from."""
    if key in PASSAGE_METRICS:
        return "passages"
    task = key.removeprefix("recall_")
    return "needle" if task == "needle_depth_0_10" else task


class TokenizerLike(Protocol):
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class SuiteSpec:
    """What the gate runs. ``prompts`` sizes every judged group: needles at depths 0-10 %,
    needles deeper (so needle recall as a whole has twice as many), multi-needle, multi-turn,
    variable tracking and instruction following; one held-out passage per
    ``prompts_per_passage`` prompts. Needles go round-robin over the (length, depth) cells.
    ``weights`` multiplies some groups: a group has ``prompts_of(task)`` prompts, so
    ``--prompts N`` scales the whole suite and keeps its proportions.

    Why per group: a paired interval narrows with the prompts of its own group; with 5-point
    margins and 95 % bounds, a group whose prompts all agree on both sides decides at 52 (see
    :mod:`kvserve.quality.stats`), a group whose answers flip both ways at a few percent needs
    hundreds. ``quick()`` (12) can only FAIL a gross loss: it reports INCONCLUSIVE for anything
    else. ``default()`` (64) can pass a format that changes almost no answer; ``full()`` sizes
    each group for a format that flips answers both ways with no loss or one well inside the
    margin (:data:`FULL_WEIGHTS`); a loss nearer the margin needs a larger group of its own
    (``tasks``).

    ``tasks`` runs a subset of :data:`TASKS`: a group the whole suite left INCONCLUSIVE can
    grow to the size that decides it without rerunning the groups that already decided (their
    prompts do not change: each has its own seeds). A verdict covers the tasks that ran.
    ``name`` is the size's flag (``quick``, ``default``, ``full``): the contexts and weights
    that a run of more prompts must repeat to extend this one's groups."""

    prompts: int = 64
    lengths: tuple[int, ...] = (256, 512, 1024)
    early_depths: tuple[float, ...] = (0.0, 5.0, 10.0)
    late_depths: tuple[float, ...] = (25.0, 50.0, 75.0, 100.0)
    multi_needle_length: int = 512
    num_needles: int = 4
    multi_turn_length: int = 512
    variable_tracking_length: int = 512
    instruction_length: int = 192
    instruction_max_tokens: int = 48
    passage_length: int = 512
    prompts_per_passage: int = 4
    seed: int = 0
    tasks: tuple[str, ...] = TASKS
    weights: tuple[tuple[str, int], ...] = ()
    name: str = "default"

    def __post_init__(self) -> None:
        if self.prompts < 1:
            raise ConfigError(f"prompts: must be >= 1, got {self.prompts}")
        for task, w in self.weights:
            if task not in TASKS or w < 1:
                raise ConfigError(
                    f"weights: {task} x{w}; tasks from {', '.join(TASKS)}, weights >= 1"
                )
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ConfigError(
                f"tasks: {', '.join(bad) or 'none given'}; choose from {', '.join(TASKS)}"
            )
        if max(self.early_depths) > EARLY_DEPTH or min(self.late_depths) <= EARLY_DEPTH:
            raise ConfigError(
                f"early_depths: must be <= {EARLY_DEPTH:g} % and late_depths above it, got "
                f"{self.early_depths} and {self.late_depths}"
            )

    @classmethod
    def default(cls) -> SuiteSpec:
        return cls()

    @classmethod
    def quick(cls) -> SuiteSpec:
        return cls(
            name="quick",
            prompts=12,
            lengths=(256, 1024),
            multi_needle_length=256,
            multi_turn_length=384,
            variable_tracking_length=256,
            instruction_length=128,
            passage_length=256,
        )

    @classmethod
    def full(cls) -> SuiteSpec:
        """The default's contexts with about three times the prompts per group, and several
        times that in the groups whose answers flip both ways (:data:`FULL_WEIGHTS`)."""
        return cls(name="full", prompts=200, weights=FULL_WEIGHTS)

    def prompts_of(self, task: str) -> int:
        """The prompts of ``task``'s group (of each depth band for ``needle``)."""
        return self.prompts * dict(self.weights).get(task, 1)

    @property
    def passages(self) -> int:
        if "passages" not in self.tasks:
            return 0
        return max(1, self.prompts_of("passages") // self.prompts_per_passage)

    def with_prompts(self, prompts: int) -> SuiteSpec:
        return replace(self, prompts=prompts)

    def with_tasks(self, tasks: tuple[str, ...]) -> SuiteSpec:
        """The same suite with only ``tasks``, in :data:`TASKS`' order (an unknown name first,
        so that the spec refuses it, naming the field)."""
        order = {t: i for i, t in enumerate(TASKS)}
        named = sorted(dict.fromkeys(tasks), key=lambda t: order.get(t, -1))
        return replace(self, tasks=tuple(named))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passages": self.passages}


@dataclass(slots=True)
class TaskItem:
    """One generation prompt: the expected ``answer`` and how many tokens to generate."""

    kind: str  # needle | multi_needle | multi_turn | variable_tracking | instruction
    prompt_ids: list[int]
    answer: str
    max_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Suite:
    spec: SuiteSpec
    items: list[TaskItem]
    passages: list[list[int]]  # held-out text for perplexity, agreement and KL
    chat_template: str  # "model" | "none (plain-text turns)"
    skipped: dict[str, str] = field(default_factory=dict)  # "task@length" -> why

    def total_lens(self) -> list[int]:
        """Tokens each request holds at its end (prompt + generated), for sizing the pool."""
        return [len(i.prompt_ids) + i.max_tokens for i in self.items] + [
            len(p) + 1 for p in self.passages
        ]


def answers_match(text: str, answer: str) -> bool:
    """Exact match of the greedy continuation: it starts with ``answer`` and does not run on
    into more of the same word (' 4831907' followed by '2' is a different code)."""
    if not text.startswith(answer):
        return False
    rest = text[len(answer) :]
    return not rest or not rest[0].isalnum()


def item_hit(text: str, item: TaskItem) -> bool:
    """The greedy continuation answers ``item``: its exact answer, or one of the equally
    right forms the task lists in ``meta["accept"]`` (variable tracking: a shorter walk of the
    chain, or the value at once); for an instruction, the response follows it."""
    if item.kind == "instruction":
        return I.follows(text, item.meta)
    return any(answers_match(text, a) for a in (item.answer, *item.meta.get("accept", ())))


def _seed(spec: SuiteSpec, *parts: object) -> int:
    return zlib.crc32(":".join(map(str, (spec.seed, *parts))).encode())


def _plain_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """Fallback for a model without a chat template: labelled plain-text turns."""
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return text + ("Assistant: " if add_generation_prompt else "")


def build_suite(tok: TokenizerLike, spec: SuiteSpec, max_model_len: int) -> Suite:
    """Render every task through ``tok``. A task at a length that does not fit
    ``max_model_len`` (with room for the answer), or that is too short for the task's own text
    in this tokenizer, is skipped and listed in ``Suite.skipped``, never silently clipped."""

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=True))

    def count_raw(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    room = max_model_len - 64  # answers are short; keep a margin for their tokens
    skipped: dict[str, str] = {}

    def item(p: T.TaskPrompt, special: bool) -> TaskItem:
        ids = tok.encode(p.prompt, add_special_tokens=special)
        full = tok.encode(p.prompt + p.answer, add_special_tokens=special)
        if full[: len(ids)] == ids:
            n_ans = len(full) - len(ids)
        else:  # the answer merged with the prompt's last token: count it on its own
            n_ans = len(tok.encode(p.answer, add_special_tokens=False))
        # +2: room to see that the answer is not continued ("... 4831907" then "2")
        return TaskItem(p.kind, ids, p.answer, n_ans + 2, dict(p.meta))

    def group(name: str, length: int, make: Callable[[int], TaskItem]) -> list[TaskItem]:
        """The task's items at one length, or none (and why) if it cannot be built; none when
        the spec leaves the task out."""
        if name not in spec.tasks:
            return []
        if length > room:
            skipped[f"{name}@{length}"] = f"longer than max_model_len - 64 ({room})"
            return []
        try:
            return [make(i) for i in range(spec.prompts_of(name))]
        except ValueError as e:  # too short for the task's fixed text in this tokenizer
            skipped[f"{name}@{length}"] = str(e)
            return []

    def needles(depths: tuple[float, ...]) -> list[TaskItem]:
        """``prompts_of("needle")`` needles round-robin over the cells (length, depth) that
        fit."""
        cells = []
        for length in spec.lengths:
            if length > room:
                skipped[f"needle@{length}"] = f"longer than max_model_len - 64 ({room})"
            else:
                cells += [(length, depth) for depth in depths]
        out: list[TaskItem] = []
        for i in range(spec.prompts_of("needle") if cells else 0):
            length, depth = cells[i % len(cells)]
            seed = _seed(spec, "needle", length, depth, i // len(cells))
            try:
                it = item(T.needle_prompt(seed, length, depth, count), True)
            except ValueError as e:  # too short for the needle's own text in this tokenizer
                skipped[f"needle@{length}"] = str(e)
                continue
            it.meta.update(context_tokens=length, depth_percent=depth)
            out.append(it)
        return out

    items = []
    if "needle" in spec.tasks:
        items = needles(spec.early_depths) + needles(spec.late_depths)
    ln, k = spec.multi_needle_length, spec.num_needles
    items += group(
        "multi_needle",
        ln,
        lambda i: item(T.multi_needle_prompt(_seed(spec, "mn", i), ln, count, num_needles=k), True),
    )
    l2 = spec.variable_tracking_length
    items += group(
        "variable_tracking",
        l2,
        lambda i: item(T.variable_tracking_prompt(_seed(spec, "vt", i), l2, count), True),
    )
    render, special, chat = _chat_renderer(tok)
    turn_count: Callable[[str], int] = count if special else count_raw
    l3 = spec.multi_turn_length
    items += group(
        "multi_turn",
        l3,
        lambda i: item(
            T.multi_turn_prompt(_seed(spec, "mt", i), l3, turn_count, render=render), special
        ),
    )
    l4 = spec.instruction_length

    def instruction(i: int) -> TaskItem:
        p = I.instruction_prompt(_seed(spec, "if", i), i, l4, turn_count, render)
        it = item(p, special)
        it.max_tokens = spec.instruction_max_tokens
        return it

    items += group("instruction", l4, instruction)

    plen = min(spec.passage_length, room)
    passages = []
    if spec.passages:
        texts = T.heldout_passages(spec.passages, plen, count, seed=_seed(spec, "ppl"))
        passages = [tok.encode(t, add_special_tokens=True) for t in texts]
    return Suite(spec, items, passages, chat, skipped)


def _chat_renderer(tok: TokenizerLike) -> tuple[T.RenderFn, bool, str]:
    """The model's chat template if it has one that renders our turns; else plain text.
    Returns (render, add_special_tokens when encoding, description)."""
    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    if tok.chat_template:
        try:
            tok.apply_chat_template(probe, True)

            def render(messages: list[dict[str, str]], gen: bool) -> str:
                return tok.apply_chat_template(messages, gen)

            return render, False, "model"
        except Exception:  # noqa: BLE001 - any template failure means: fall back
            pass
    return _plain_chat, True, "none (plain-text turns)"
