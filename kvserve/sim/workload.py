"""A workload's text as a simulated engine counts and encodes it: the token counter a workload
generator needs, and a long trace made and tokenized in another process while it is replayed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvserve.bench.forks import fork_iter
from kvserve.bench.workloads import BenchRequest, WorkloadSpec, check_workload_spec, iter_workload
from kvserve.sim.engine import SimTarget, build_engine
from kvserve.sim.tokenizer import HashTokenizer


def token_counter(target: SimTarget) -> tuple[Callable[[str], int], int]:
    """(token counter, max model length) the workload generator needs, from a simulated
    engine built for the purpose (its tokenizer, or the hashed one)."""
    count, _, max_len = _text_tools(target)
    return count, max_len


def _text_tools(
    target: SimTarget,
) -> tuple[Callable[[str], int], Callable[[str], list[int]], int]:
    """(token counter, encoder, max model length) of ``target``'s simulated engine."""
    sim = build_engine(target)
    encode = sim.encode
    tok = getattr(encode, "__self__", None)
    count = tok.count if isinstance(tok, HashTokenizer) else (lambda s: len(encode(s)))
    return count, encode, sim.engine.max_model_len


class EncodedWorkload(Sequence[BenchRequest]):
    """A workload made and tokenized in another process while the replay consumes it
    (:func:`stream_workload`): request ``i`` is taken from the producer when first asked
    for, with its prompt's token ids, which the replay takes instead of encoding again."""

    def __init__(self, items: Iterator[tuple[BenchRequest, list[int]]], n: int) -> None:
        self._items = items
        self._n = n
        self._reqs: list[BenchRequest] = []
        self._ids: list[list[int] | None] = []

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> BenchRequest:  # type: ignore[override]
        if not 0 <= i < self._n:
            raise IndexError(i)
        while len(self._reqs) <= i:
            req, ids = next(self._items)
            self._reqs.append(req)
            self._ids.append(ids)
            if len(self._reqs) == self._n:  # the producer's end: it exits, and is reaped
                for _ in self._items:
                    raise RuntimeError(f"the workload made more than its {self._n} requests")
        return self._reqs[i]

    def token_ids(self, i: int) -> list[int]:
        """Request ``i``'s prompt ids, handed over once (the engine keeps its own)."""
        self[i]
        ids = self._ids[i]
        if ids is None:
            raise RuntimeError(f"request {i}'s token ids were already taken")
        self._ids[i] = None
        return ids


def stream_workload(target: SimTarget, spec: WorkloadSpec) -> EncodedWorkload:
    """``make_workload(spec, token_counter(target)[0])``, tokenized as ``target``'s engine
    encodes prompts, made in a forked process while this one replays it: on a machine with
    a core to spare, a long trace's text costs the replay little instead of running first.
    A spec error is raised here; a prompt too long for ``spec.max_model_len`` when the
    replay reaches it."""
    check_workload_spec(spec)

    def make() -> Iterator[tuple[BenchRequest, list[int]]]:
        count, encode, _ = _text_tools(target)
        for r in iter_workload(spec, count):
            yield r, encode(r.prompt)

    return EncodedWorkload(fork_iter(make), spec.num_prompts)
