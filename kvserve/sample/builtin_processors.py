"""The built-in logits processors and their order (see :mod:`kvserve.sample.logits_processors`).

Each builds what it needs every step (token id and value tensors on the device) once, when a
request joins, and applies itself to all of its rows at once: a scatter into the logits, or a
few elementwise passes over its rows (penalties), with no tensor op per row or per token.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from kvserve.kernels.host_device import to_device
from kvserve.sample.logits_processors import (
    LogitsProcessor,
    LogitsProcessors,
    RequestLogitsState,
    RequestView,
    put_rows,
    select_rows,
)
from kvserve.sample.structured_outputs import StructuredOutputsLogitsProcessor
from kvserve.sample.token_bitmask import AllowedTokenIdsLogitsProcessor
from kvserve.structured.compiler import GrammarCompiler


class Penalties(RequestLogitsState):
    __slots__ = ("repetition", "frequency", "presence", "prompt_ids", "output")

    def __init__(
        self, repetition: float, frequency: float, presence: float,
        prompt_ids: torch.Tensor | None, output: list[int],
    ) -> None:  # fmt: skip
        self.repetition, self.frequency, self.presence = repetition, frequency, presence
        self.prompt_ids = prompt_ids  # distinct prompt ids, only under a repetition penalty
        self.output = output  # the request's live output list


class PenaltiesLogitsProcessor(LogitsProcessor[Penalties]):
    """vLLM's penalties. Repetition divides the positive logits (and multiplies the negative
    ones) of every token seen in the prompt or the output; frequency subtracts its value times
    the token's count in the output; presence its value once for a token in the output.

    Not additive (repetition scales), so greedy rescoring leaves its rows alone. The output
    counts are rebuilt each step from the requests' output lists in one scatter."""

    additive = False

    def new_state(self, request: RequestView) -> Penalties | None:
        p = request.sampling_params
        if not p.uses_penalties:
            return None
        prompt = None
        if p.repetition_penalty != 1.0:
            ids = sorted({t for t in request.prompt_token_ids if 0 <= t < self.vocab_size})
            prompt = to_device(ids, self.device, torch.long)
        return Penalties(p.repetition_penalty, p.frequency_penalty, p.presence_penalty, prompt,
                         request.output_token_ids)  # fmt: skip

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[Penalties]) -> torch.Tensor:
        dev, n, v = logits.device, len(rows), logits.shape[1]
        x, index = select_rows(logits, rows)
        counts = torch.zeros(n, v, device=dev)
        lens = [len(s.output) for s in states]
        if sum(lens):
            # the row of each token, built on the host: a device-side repeat would have to
            # read its output size back first
            tok = to_device(list(chain.from_iterable(s.output for s in states)), dev, torch.long)
            row = to_device(np.repeat(np.arange(n), lens), dev)
            counts.index_put_((row, tok), torch.ones((), device=dev), accumulate=True)
        seen = counts > 0
        prompts = [(i, s.prompt_ids) for i, s in enumerate(states) if s.prompt_ids is not None]
        if prompts:
            ids = torch.cat([t for _, t in prompts])
            row = to_device(np.repeat([i for i, _ in prompts], [len(t) for _, t in prompts]),
                            dev)  # fmt: skip
            seen.index_put_((row, ids), torch.ones((), dtype=torch.bool, device=dev))
        names = ("repetition", "frequency", "presence")
        rep, freq, pres = to_device([[getattr(s, a) for s in states] for a in names], dev,
                                    torch.float32)[:, :, None]  # fmt: skip
        penalised = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(seen, penalised, x)
        x = x - freq * counts - pres * (counts > 0).float()
        return put_rows(logits, index, x)


class MinTokens(RequestLogitsState):
    __slots__ = ("min_tokens", "stop_ids", "output")

    def __init__(self, min_tokens: int, stop_ids: list[int], output: list[int]) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = stop_ids
        self.output = output

    def active(self) -> bool:
        return len(self.output) < self.min_tokens


class MinTokensLogitsProcessor(LogitsProcessor[MinTokens]):
    """vLLM's ``min_tokens``: the request's EOS and ``stop_token_ids`` are masked while it has
    fewer output tokens (stop strings are checked on text, after the step)."""

    def new_state(self, request: RequestView) -> MinTokens | None:
        p = request.sampling_params
        if not p.min_tokens:
            return None
        stops = set(request.eos_token_ids) | set(p.stop_token_ids or ())
        stops = sorted(t for t in stops if 0 <= t < self.vocab_size)
        return MinTokens(p.min_tokens, stops, request.output_token_ids) if stops else None

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[MinTokens]) -> torch.Tensor:
        r = [row for row, s in zip(rows, states, strict=True) for _ in s.stop_ids]
        c = [t for s in states for t in s.stop_ids]
        dev = logits.device
        idx = to_device([r, c], dev, torch.long)
        return logits.index_put_((idx[0], idx[1]), torch.full((), float("-inf"), device=dev))


class LogitBias(RequestLogitsState):
    __slots__ = ("token_ids", "values")

    def __init__(self, token_ids: torch.Tensor, values: torch.Tensor) -> None:
        self.token_ids = token_ids
        self.values = values


class LogitBiasLogitsProcessor(LogitsProcessor[LogitBias]):
    """OpenAI's and vLLM's ``logit_bias``: a value in [-100, 100] added to a token's logit."""

    def new_state(self, request: RequestView) -> LogitBias | None:
        bias = request.sampling_params.logit_bias
        if not bias:
            return None
        items = sorted((t, float(b)) for t, b in bias.items() if 0 <= t < self.vocab_size)
        if not items:
            return None
        ids = to_device([t for t, _ in items], self.device, torch.long)
        return LogitBias(ids, to_device([b for _, b in items], self.device, torch.float32))

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[LogitBias]) -> torch.Tensor:
        dev = logits.device
        ids = [s.token_ids for s in states]
        row = to_device(np.repeat(rows, [len(t) for t in ids]), dev)
        values = torch.cat([s.values for s in states])
        return logits.index_put_((row, torch.cat(ids)), values, accumulate=True)


# The registry, in the order the processors apply; the structured-outputs mask (which needs
# the grammar compiler) comes last, after every processor that can move the argmax.
LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    PenaltiesLogitsProcessor,
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    AllowedTokenIdsLogitsProcessor,
)


def build_logits_processors(
    vocab_size: int,
    device: torch.device | str = "cpu",
    grammar_compiler: GrammarCompiler | None = None,
) -> LogitsProcessors:
    """The built-in processors for a model of ``vocab_size`` on ``device``, in order;
    ``grammar_compiler``: what structured-output requests compile with (None: refused)."""
    procs = [cls(vocab_size, device) for cls in LOGITS_PROCESSORS]
    procs.append(StructuredOutputsLogitsProcessor(vocab_size, device, grammar_compiler))
    return LogitsProcessors(procs)
