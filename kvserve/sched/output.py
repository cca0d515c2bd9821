"""What crosses the seams of one engine step, as plain picklable data.

``Scheduler.schedule()`` produces a :class:`SchedulerOutput`; a runner (the model runner, a
fake, a cost model, a worker in another process) turns it into a :class:`ModelRunnerOutput`;
``Scheduler.update_from_output()`` applies that to request state. Neither side holds the
other's objects: the runner keeps its own per-request sampling state, created from
:class:`NewRequestData` and dropped on ``finished_req_ids``.

Positions and cache indices are separate on purpose. A scheduled sequence's new tokens have
RoPE positions ``position, position + 1, ...`` and go to cache entries ``num_cached,
num_cached + 1, ...`` of its block table (entry ``j`` lives in block ``block_ids[j //
block_size]`` at offset ``j % block_size``); token ``i`` attends to the ``num_cached + i + 1``
entries before and including itself. Both counts start at the number of computed tokens: a
retention window drops whole leading blocks (their table entries become the null block), so
indices keep their meaning. SnapKV compacts: in the step that ends the prompt the runner copies
each layer's and KV head's kept entries into ``compact_block_ids``, after which positions go on
growing while the cache stays short.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

import numpy as np

from kvserve.connectors.base import KVConnectorOutput
from kvserve.kv.ops import KVOps
from kvserve.sched.request import SamplingParams

_T = TypeVar("_T")

# Async scheduling: a step planned while the one before it runs feeds each decoding sequence
# the token that step samples, which the scheduler does not know yet. It sends this in that
# token's place, and the runner puts its own sample there (every rank holds the same).
PENDING_TOKEN_ID = -1


def pickled_by_fields(cls: type[_T]) -> type[_T]:
    """Pickle instances of the dataclass ``cls`` as its constructor and its field values.

    A slots dataclass otherwise pickles through the ``__getstate__`` / ``__setstate__`` that
    ``dataclass`` writes, which call :func:`dataclasses.fields` on every object, and then
    spells out each field's name: with another process per rank, every step's message and
    its reply pay that on both sides, between the steps, on caches the step just filled."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    assert len(names) > 1  # attrgetter of one name returns the value, not a tuple
    get = operator.attrgetter(*names)

    def __reduce__(self: _T) -> tuple[type[_T], tuple[Any, ...]]:  # noqa: N807
        return cls, get(self)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign, assignment]
    return cls


@pickled_by_fields
@dataclass(slots=True)
class NewRequestData:
    """Sampling state a runner creates the first time it sees a request."""

    req_id: str
    prompt_token_ids: list[int]  # repetition penalty counts the prompt
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_token_ids: list[int] = field(default_factory=list)


@pickled_by_fields
@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of the step."""

    req_id: str
    token_ids: list[int]  # the new tokens to compute
    position: int  # RoPE position of token_ids[0]; the others follow
    num_cached: int  # cache entries before this step (where token_ids[0]'s K/V go)
    block_ids: list[int]  # the request's block table
    # Requests that sample one token each from the last row's logits: (req_id,) when the
    # chunk reaches the request's newest token, plus the forked siblings of an n > 1 request
    # at its first token; () for a prefill chunk that stops short.
    sample_ids: tuple[str, ...] = ()
    # Leading rows whose log-softmax over the vocabulary the request asked for (prompt logits).
    num_prompt_logit_rows: int = 0
    # The request's retention window: each token attends to the newest ``window`` cache
    # entries up to itself (0: all of them; a layer's own sliding window applies as well).
    window: int = 0
    # ... plus, with a window, the first ``sinks`` cache entries (StreamingLLM; 0: none).
    sinks: int = 0
    # H2O: the runner accumulates the attention mass each cache entry receives.
    observe: bool = False
    # A compaction after this step's attention: ("snapkv", budget, observation window,
    # pooling width) in the chunk that ends the prompt, or ("h2o", budget, recent, 0); every
    # layer copies its kept entries, in order, into the fresh ``compact_block_ids``.
    compact: tuple[str, int, int, int] | tuple[()] = ()
    compact_block_ids: list[int] | tuple[()] = ()  # a list when the step compacts
    # A hybrid model's other layer groups' tables (kvserve.kv.layer_groups): group g's is
    # ``group_block_ids[g - 1]``; ``block_ids`` is group 0's.
    group_block_ids: tuple[list[int], ...] = ()

    @property
    def per_sequence(self) -> bool:
        """Needs more than the plain paged attention (sinks, a compaction's scoring, H2O's
        mass): the runner groups it for the fused kernel only where the KV format's kernel
        serves retention (``AttentionBackend.serves_retention``), else attends it on its
        own."""
        return bool(self.sinks or self.compact or self.observe)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.position, self.position + len(self.token_ids))

    def cache_slots(self, block_size: int) -> np.ndarray:
        """Flat slot index (block id * block_size + offset) of each new token's K/V."""
        idx = np.arange(self.num_cached, self.num_cached + len(self.token_ids), dtype=np.int64)
        table = np.asarray(self.block_ids, dtype=np.int64)
        return table[idx // block_size] * block_size + idx % block_size


@pickled_by_fields
@dataclass(slots=True)
class SchedulerOutput:
    """Everything a runner needs to execute one step."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    kv_ops: KVOps = field(default_factory=KVOps)
    preempted_req_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # What the KV connectors' worker side moves this step (block ids and hashes; None:
    # nothing); see kvserve.connectors.base.
    kv_connector_metadata: Any = None
    # Some sequence's last token is PENDING_TOKEN_ID (async scheduling).
    pending_token_ids: bool = False

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@pickled_by_fields
@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens, one per entry of the scheduled sequences' ``sample_ids``."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Per sampled token: {token_id: logprob} with the sampled token and the top-n, or None.
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    sampled_logprobs: list[float] | None = None
    # req_id -> [rows, vocab] log-softmax of the prompt positions computed this step
    prompt_logits: dict[str, Any] = field(default_factory=dict)
    # The KV connectors' report of the step (None: no connector, or nothing to report)
    kv_connector_output: KVConnectorOutput | None = None


class Runner(Protocol):
    """Anything that executes a step: the model runner, a fake, a cost model, a remote worker."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
