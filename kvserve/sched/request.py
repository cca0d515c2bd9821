"""Requests, sampling parameters and the outputs the engine streams back (vLLM-shaped)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import ConfigError
from kvserve.errors import InvalidRequestError
from kvserve.sched.retention import RetentionSpec, parse_retention
from kvserve.sched.workload_classes import WorkloadClass
from kvserve.structured.params import StructuredOutputsParams


def _bad(field: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {message}", field=field)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; the fields and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Log-probabilities of the prompt's own tokens (top-n beside the actual token), as vLLM.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # A KV retention policy for this request ("window:512"), over the engine's default
    # (--kv-retention); "none" turns the default off. Lossy: see kvserve.sched.retention.
    kv_retention: str | None = None
    # Added to the named tokens' logits before sampling (OpenAI's and vLLM's), each in
    # [-100, 100]: -100 all but forbids a token, +100 all but forces it.
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens may be sampled (a non-empty list).
    allowed_token_ids: list[int] | None = None
    # vLLM's: the output matches a JSON schema, a regex, a choice or a grammar
    # (kvserve.structured); checked against the tokenizer when the engine takes the request.
    structured_outputs: StructuredOutputsParams | None = None

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise _bad(name, f"must be a number, got {v!r}")
            if v != v or v in (float("inf"), float("-inf")):
                raise _bad(name, f"must be finite, got {v!r}")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise _bad(name, f"must be an integer, got {v!r}")
            return v

        if integer("n") < 1 or self.n > 128:
            raise _bad("n", f"must be in [1, 128], got {self.n}")
        if number("temperature") < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if integer("top_k") < -1 or self.top_k == 0:
            raise _bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= number("min_p") <= 1:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise _bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < number("repetition_penalty") <= 2:
            raise _bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None:
            integer("seed")
        if self.max_tokens is not None and integer("max_tokens") < 1:
            raise _bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if integer("min_tokens") < 0:
            raise _bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= integer("logprobs") <= self.MAX_LOGPROBS:
            raise _bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (
            0 <= integer("prompt_logprobs") <= self.MAX_LOGPROBS
        ):
            raise _bad(
                "prompt_logprobs",
                f"must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        if self.kv_retention is not None:
            if not isinstance(self.kv_retention, str):
                raise _bad("kv_retention", f"must be a string such as 'window:512', got "
                           f"{self.kv_retention!r}")  # fmt: skip
            try:
                parse_retention(self.kv_retention)
            except ConfigError as e:
                raise InvalidRequestError(str(e), field="kv_retention") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise _bad("stop", "must be a string or a list of strings")
            if any(s == "" for s in self.stop):
                raise _bad("stop", "stop strings must be non-empty")
            if len(self.stop) > 16:
                raise _bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise _bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not all(_is_token_id(t) for t in ids):
                raise _bad("allowed_token_ids", "must be a list of token ids (integers >= 0)")
            if not ids:
                raise _bad("allowed_token_ids", "must not be empty")
            self.allowed_token_ids = list(ids)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise _bad("structured_outputs", f"must be a StructuredOutputsParams, got {so!r}")

    def _check_logit_bias(self) -> None:
        bias, top = self.logit_bias, self.MAX_LOGIT_BIAS
        if not isinstance(bias, dict):
            raise _bad("logit_bias", f"must be a mapping of token id to bias, got {bias!r}")
        for t, b in bias.items():
            if not _is_token_id(t):
                raise _bad("logit_bias", f"keys must be token ids (integers >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, int | float) or not -top <= b <= top:
                raise _bad("logit_bias", f"the bias of token {t} must be a number in "
                           f"[{-top:g}, {top:g}], got {b!r}")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


PRIORITY_RANGE = (-(2**31), 2**31 - 1)


@dataclass(slots=True, frozen=True)
class RequestTags:
    """Who sent a request and how it asks to be scheduled, beside how to sample it.

    ``priority`` is vLLM's (lower is served first, under ``scheduling_policy="priority"``;
    None: the workload class's, else 0); ``workload_class`` names a class of the engine's
    class file outright; ``tenant`` (set by the server from the API key) and ``user`` (the
    OpenAI field) are what a class file matches on."""

    priority: int | None = None
    workload_class: str | None = None
    tenant: str | None = None
    user: str | None = None
    # vLLM's disaggregation protocol (kvserve.disagg): {"do_remote_decode": true} on a prefill
    # engine; the prefill engine's answer on a decode engine.
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        kp = self.kv_transfer_params
        if kp is not None and not isinstance(kp, dict):
            raise _bad("kv_transfer_params", f"must be a JSON object, got {kp!r}")
        p = self.priority
        if p is not None:
            lo, hi = PRIORITY_RANGE
            if isinstance(p, bool) or not isinstance(p, int) or not lo <= p <= hi:
                raise _bad("priority", f"must be an integer in [{lo}, {hi}], got {p!r}")
        wc = self.workload_class
        if wc is not None and (not isinstance(wc, str) or not wc):
            raise _bad("workload_class", f"must be a non-empty string, got {wc!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the step that computed it failed (a runner error)
    FINISHED_REFUSED = "refused"  # admission control refused it before it ran (see .refusal)

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


# Asked for every running request at every step. A tuple, not a set: membership by identity
# skips Enum's Python-level __hash__.
FINISHED_STATUSES = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
    RequestStatus.FINISHED_REFUSED,
)


@dataclass(slots=True)
class RequestMetrics:
    """Times of a request's life, read from the engine's clock (``time.monotonic`` unless
    the engine was given another)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


class Request:
    """One sequence being generated: its tokens and progress, as the scheduler tracks them.

    ``num_computed_tokens`` counts tokens whose K/V sit in the cache; the scheduler hands the
    model ``all_token_ids[num_computed_tokens:]`` (bounded by the budget), which is the whole
    prompt chunk by chunk during prefill and the single newest token during decode. Sampling
    state (seeded generators) lives in the runner, text in the engine's output processor.
    ``forks`` are the other samples of an ``n > 1`` request: they wait, holding nothing, until
    this one's first token, then share its blocks and draw their first tokens from the same
    logits.
    """

    __slots__ = (
        "request_id",
        "prompt",
        "prompt_token_ids",
        "all_token_ids",
        "sampling_params",
        "max_tokens",
        "eos_token_ids",
        "cache_salt",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_pending",
        "num_cached_tokens",
        "num_preemptions",
        "block_hashes",
        "output_logprobs",
        "cumulative_logprob",
        "stop_reason",
        "metrics",
        "skips",
        "priority",
        "seq_no",
        "workload_class",
        "expected_output_tokens",
        "refusal",
        "prompt_logits",
        "parent_id",
        "index",
        "forks",
        "error",
        "retention",
        "num_evicted_tokens",
        "cache_offset",
        "loading",
        "load_block_ids",
        "load_num_tokens",
        "num_transferred_tokens",
        "kv_transfer_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float = 0.0,
        parent_id: str | None = None,
        index: int = 0,
        retention: RetentionSpec | None = None,
        priority: int = 0,
        workload_class: WorkloadClass | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        # A grammar's end is an EOS the mask forces: it stops a constrained request even under
        # ignore_eos (the grammar decides where the output ends).
        keep_eos = not sampling_params.ignore_eos or sampling_params.structured_outputs is not None
        self.eos_token_ids = tuple(eos_token_ids) if keep_eos else ()
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling: tokens a step in flight samples, counted in num_computed_tokens
        # by the step that feeds them to the model before they are in all_token_ids.
        self.num_pending = 0
        self.num_cached_tokens = -1  # set at first scheduling
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.output_logprobs: list[dict[int, float]] | None = (
            [] if sampling_params.logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # Times a later request was admitted ahead of this one (bounded: kvserve.sched.waiting).
        self.skips = 0
        self.priority = priority  # vLLM's meaning: lower is served first
        self.seq_no = 0  # arrival order in the scheduler (ties of priority)
        self.workload_class = workload_class
        # Projected admission: output tokens reserved for it, fixed when first projected.
        self.expected_output_tokens: int | None = None
        self.refusal: Any = None  # kvserve.sched.admission.Refusal when admission refused it
        # Per-chunk [n, vocab] log-softmax rows for prompt positions, when asked for.
        self.prompt_logits: list[Any] | None = None
        self.parent_id = request_id if parent_id is None else parent_id
        self.index = index
        self.forks: list[Request] = []
        self.error: str | None = None
        # The request's retention policy (None: keep every token) and how many of its tokens'
        # K/V it has dropped so far (counted again after a preemption recomputes them).
        self.retention = retention
        self.num_evicted_tokens = 0
        # Computed tokens whose cache entries a compaction (SnapKV) removed: the cache holds
        # num_computed_tokens - cache_offset entries, RoPE positions go on from
        # num_computed_tokens. Zero until the compaction, and again after a preemption.
        self.cache_offset = 0
        # A KV connector (an offload tier, another engine) loads blocks for it: the request
        # then waits, holding the fresh blocks they go to (kvserve.sched.kv_loads).
        self.loading = False
        self.load_block_ids: list[int] = []
        self.load_num_tokens = 0  # tokens the load covers (its last block may be partial)
        self.num_transferred_tokens = 0  # prompt tokens a peer engine computed (not cache hits)
        # What the request came with (vLLM's disaggregation protocol), then what the
        # connectors said when it finished (where a peer can fetch its KV), or None.
        self.kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_cache_entries(self) -> int:
        """Cache entries holding this request's computed K/V (entry j lives in table entry
        j // block_size)."""
        return self.num_computed_tokens - self.cache_offset

    @property
    def compaction_pending(self) -> bool:
        """A SnapKV request whose prompt is still to be compacted at its end."""
        r = self.retention
        return (
            r is not None and r.compacts_prompt(self.num_prompt_tokens) and self.cache_offset == 0
        )

    @property
    def wants_prompt_logits(self) -> bool:
        return self.prompt_logits is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


@dataclass(slots=True)
class CompletionOutput:
    """One sampled sequence of a request (``n`` of them when ``SamplingParams.n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """What the engine returns for a request after a step (streamed) or at the end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Prompt tokens whose KV a peer engine computed and sent (disaggregated prefill): apart
    # from num_cached_tokens, which counts only this engine's prefix-cache hits.
    num_transferred_tokens: int = 0
    # vLLM shape: None for the first token, then {token_id: logprob} per prompt position.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # [num_prompt_tokens, vocab] log-probs (row i predicts token i + 1; the last row the first
    # output token), only when add_request(..., return_prompt_logits=True): for eval tooling.
    prompt_logits: Any = None
    # Why the request finished with finish_reason "error" (its engine step failed), else None.
    error: str | None = None
    # Under a retention policy: tokens whose K/V the cache still holds vs tokens seen (prompt
    # and output); both None when the request keeps everything.
    num_retained_tokens: int | None = None
    num_seen_tokens: int | None = None
    # Admission control refused it before it ran (finish_reason "refused"): why, and when to
    # retry (kvserve.sched.admission.Refusal).
    refusal: Any = None
    # The workload class it was matched to (None: the engine has no class file).
    workload_class: str | None = None
    # What the KV connectors said when it finished (vLLM's field: where a peer can fetch its
    # KV), or None.
    kv_transfer_params: dict[str, Any] | None = None
