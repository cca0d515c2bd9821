"""Turning request state into what callers see: text, stop strings, stream deltas, outputs.

A user request is a :class:`RequestFamily` of ``n`` sampled sequences. After each step the
:class:`OutputProcessor` detokenizes the samples that got a token, ends those whose text
reached a stop string (through the engine core, which owns request state), and builds one
:class:`RequestOutput` per touched family with :func:`build_output`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvserve.sched.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)

FinishFn = Callable[[Request, RequestStatus, str], None]


class RequestFamily:
    """A user request and its ``n`` sampled sequences (children)."""

    __slots__ = (
        "request_id",
        "prompt",
        "prompt_token_ids",
        "params",
        "stream",
        "children",
        "detokenizers",
        "sent",
        "closed",
        "return_prompt_logits",
        "sent_prompt_logits",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        ids: list[int],
        params: SamplingParams,
        stream: bool,
        children: list[Request],
        tokenizer: Tokenizer | None = None,
        return_prompt_logits: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = ids
        self.params = params
        self.stream = stream
        self.children = children
        self.detokenizers: list[IncrementalDetokenizer | None] = [
            None
            if tokenizer is None
            else IncrementalDetokenizer(tokenizer, ids, c.sampling_params.skip_special_tokens)
            for c in children
        ]
        self.sent: dict[int, tuple[int, int]] = {}
        self.closed: set[int] = set()
        self.return_prompt_logits = return_prompt_logits
        self.sent_prompt_logits = False

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def text(self, c: Request) -> str:
        d = self.detokenizers[c.index]
        return d.text if d is not None else ""


def check_stop_strings(family: RequestFamily, r: Request) -> str | None:
    """Detokenize ``r``'s new tokens when text is needed (streaming or stop strings) and
    return the stop string its text reached, cutting the text there (or after it, with
    ``include_stop_str_in_output``)."""
    d = family.detokenizers[r.index]
    p = r.sampling_params
    if d is None or not (family.stream or p.stop):
        return None
    before = len(d.text)
    d.update(r.output_token_ids)
    if not p.stop or r.num_output_tokens < p.min_tokens:
        return None
    text = d.text
    start = max(0, before - max(len(s) for s in p.stop) + 1)
    hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
    if not hits:
        return None
    idx, stop = min(hits)
    d.text = text[: idx + len(stop) if p.include_stop_str_in_output else idx]
    return stop


def build_output(family: RequestFamily) -> RequestOutput | None:
    """The family's RequestOutput for this step: per-step deltas when streaming (holding back
    a possible stop-string prefix), else only the final cumulative output."""
    done = family.finished
    if not family.stream and not done:
        return None
    outputs = []
    for c in family.children:
        d = family.detokenizers[c.index]
        if d is not None:
            d.update(c.output_token_ids, final=c.is_finished)
        text = family.text(c)
        ids = c.output_token_ids
        lps = c.output_logprobs
        if family.stream:
            sent_t, sent_i = family.sent.get(c.index, (0, 0))
            if sent_i == len(ids) and not (c.is_finished and c.index not in family.closed):
                continue
            # Hold back a possible stop-string prefix until it is decided, so streamed
            # text never includes characters the final text cuts (as vLLM does).
            upto = len(text)
            if c.sampling_params.stop and not c.is_finished:
                hold = max(len(x) for x in c.sampling_params.stop) - 1
                upto = max(sent_t, len(text) - hold)
            family.sent[c.index] = (upto, len(ids))
            text, ids = text[sent_t:upto], ids[sent_i:]
            lps = lps[sent_i:] if lps is not None else None
            if c.is_finished:
                family.closed.add(c.index)
        outputs.append(
            CompletionOutput(
                index=c.index,
                text=text,
                token_ids=list(ids),
                cumulative_logprob=c.cumulative_logprob if lps is not None else None,
                logprobs=lps,
                finish_reason=c.status.value if c.is_finished else None,
                stop_reason=c.stop_reason,
            )
        )
    first = family.children[0]
    prompt_lp, prompt_logits = None, None
    if first.prompt_logits and not family.sent_prompt_logits:
        family.sent_prompt_logits = True
        # On the host: an output must not hold device memory (nor its caller a GPU tensor)
        prompt_logits = torch.cat(first.prompt_logits).cpu()
        n = first.sampling_params.prompt_logprobs
        if n is not None:
            prompt_lp = prompt_logprobs(prompt_logits, family.prompt_token_ids, n)
        if not family.return_prompt_logits:
            prompt_logits = None
    errors = [c.error for c in family.children if c.error]
    retained = seen = None
    if first.retention is not None:
        seen = first.num_computed_tokens
        retained = seen - first.num_evicted_tokens
    return RequestOutput(
        request_id=family.request_id,
        prompt=family.prompt,
        prompt_token_ids=family.prompt_token_ids,
        outputs=outputs,
        finished=done,
        metrics=first.metrics,
        num_cached_tokens=max(first.num_cached_tokens, 0),
        num_transferred_tokens=first.num_transferred_tokens,
        prompt_logprobs=prompt_lp,
        prompt_logits=prompt_logits,
        error=errors[0] if errors else None,
        num_retained_tokens=retained,
        num_seen_tokens=seen,
        refusal=first.refusal,
        workload_class=first.workload_class.name if first.workload_class is not None else None,
        kv_transfer_params=first.kv_transfer_params if first.is_finished else None,
    )


def prompt_logprobs(
    logits: torch.Tensor, prompt: list[int], n: int
) -> list[dict[int, float] | None]:
    """vLLM's prompt_logprobs: None for the first token, then the actual token's log-prob
    and the top-n at each later position."""
    rows = logits[: len(prompt) - 1]
    actual = rows.gather(1, torch.tensor(prompt[1:], device=rows.device)[:, None])[:, 0].tolist()
    out: list[dict[int, float] | None] = [None]
    top_v, top_i = rows.topk(n, dim=-1) if n else (None, None)
    for pos, tok in enumerate(prompt[1:]):
        entry = {tok: actual[pos]}
        if top_i is not None:
            for t, v in zip(top_i[pos].tolist(), top_v[pos].tolist(), strict=True):
                entry.setdefault(t, v)
        out.append(entry)
    return out


class OutputProcessor:
    """The families in flight and their text state; ``finish`` ends a sample whose text hit a
    stop string (the engine core's :meth:`~kvserve.engine.core.EngineCore.finish_request`)."""

    def __init__(self, tokenizer: Tokenizer | None, finish: FinishFn) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self.families: dict[str, RequestFamily] = {}

    def add(self, family: RequestFamily) -> None:
        self.families[family.request_id] = family

    def abort(self, request_id: str) -> None:
        self.families.pop(request_id, None)

    def process(self, updated: list[Request]) -> list[RequestOutput]:
        touched: dict[str, RequestFamily] = {}
        for r in updated:
            family = self.families.get(r.parent_id)
            if family is None:
                continue
            if r.status != RequestStatus.FINISHED_ERROR:
                stop = check_stop_strings(family, r)
                if stop is not None:
                    self.finish(r, RequestStatus.FINISHED_STOPPED, stop)
            touched[family.request_id] = family
        outputs = []
        for family in touched.values():
            out = build_output(family)
            if out is None:
                continue
            outputs.append(out)
            if out.finished:
                self.families.pop(family.request_id, None)
        return outputs
