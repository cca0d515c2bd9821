"""Turning engine state into what callers see: stop checks, stream deltas, RequestOutputs.

A user request is a :class:`RequestFamily` of ``n`` sampled sequences. After each step the
engine appends sampled tokens, asks :func:`check_stop` whether a sequence ended, and builds one
:class:`RequestOutput` per touched family with :func:`build_output`.
"""

from __future__ import annotations

import torch

from kvserve.request import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)


def check_stop(r: Request, token: int, stream: bool, max_model_len: int) -> bool:
    """Apply stop strings, stop tokens, EOS and length limits after ``token`` was appended;
    sets the request's status and returns True when it finished."""
    p = r.sampling_params
    n_out = r.num_output_tokens
    text_needed = stream or bool(p.stop)
    if text_needed and r.detokenizer is not None:
        before = len(r.detokenizer.text)
        r.detokenizer.update(r.output_token_ids)
        if p.stop and n_out >= p.min_tokens:
            text = r.detokenizer.text
            start = max(0, before - max(len(s) for s in p.stop) + 1)
            hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
            if hits:
                idx, stop = min(hits)
                end = idx + len(stop) if p.include_stop_str_in_output else idx
                r.detokenizer.text = text[:end]
                r.stop_reason = stop
                r.status = RequestStatus.FINISHED_STOPPED
                return True
    if n_out >= p.min_tokens:
        if token in r.eos_token_ids:
            r.status = RequestStatus.FINISHED_STOPPED
            return True
        if p.stop_token_ids and token in p.stop_token_ids:
            r.stop_reason = token
            r.status = RequestStatus.FINISHED_STOPPED
            return True
    if n_out >= r.max_tokens or r.num_tokens >= max_model_len:
        r.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def build_output(family: RequestFamily) -> RequestOutput | None:
    """The family's RequestOutput for this step: per-step deltas when streaming (holding back
    a possible stop-string prefix), else only the final cumulative output."""
    done = all(c.is_finished for c in family.children)
    if not family.stream and not done:
        return None
    outputs = []
    for c in family.children:
        if c.detokenizer is not None:
            c.detokenizer.update(c.output_token_ids, final=c.is_finished)
        text = c.detokenizer.text if c.detokenizer is not None else ""
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
        prompt_logits = torch.cat(first.prompt_logits)
        n = first.sampling_params.prompt_logprobs
        if n is not None:
            prompt_lp = prompt_logprobs(prompt_logits, family.prompt_token_ids, n)
        if not family.return_prompt_logits:
            prompt_logits = None
    return RequestOutput(
        request_id=family.request_id,
        prompt=family.prompt,
        prompt_token_ids=family.prompt_token_ids,
        outputs=outputs,
        finished=done,
        metrics=first.metrics,
        num_cached_tokens=max(first.num_cached_tokens, 0),
        prompt_logprobs=prompt_lp,
        prompt_logits=prompt_logits,
    )


def prompt_logprobs(
    logits: torch.Tensor, prompt: list[int], n: int
) -> list[dict[int, float] | None]:
    """vLLM's prompt_logprobs: None for the first token, then the actual token's log-prob
    and the top-n at each later position."""
    rows = logits[: len(prompt) - 1]
    actual = rows.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    out: list[dict[int, float] | None] = [None]
    top_v, top_i = rows.topk(n, dim=-1) if n else (None, None)
    for pos, tok in enumerate(prompt[1:]):
        entry = {tok: actual[pos]}
        if top_i is not None:
            for t, v in zip(top_i[pos].tolist(), top_v[pos].tolist(), strict=True):
                entry.setdefault(t, v)
        out.append(entry)
    return out


class RequestFamily:
    """A user request and its ``n`` sampled sequences (children)."""

    __slots__ = (
        "request_id",
        "prompt",
        "prompt_token_ids",
        "params",
        "stream",
        "children",
        "pending_forks",
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
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = ids
        self.params = params
        self.stream = stream
        self.children: list[Request] = []
        self.pending_forks: list[Request] = []
        self.sent: dict[int, tuple[int, int]] = {}
        self.closed: set[int] = set()
        self.return_prompt_logits = False
        self.sent_prompt_logits = False
