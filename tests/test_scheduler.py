"""The scheduler on its own, against a small fake KV manager (plain block counting, no prefix
cache): preemption order, chunked-prefill budgets, priorities, and blocks a connector holds
after a request finished (delay_free). The expectations are worked out by hand from the rules
in kvserve/sched/scheduler.py's docstring."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.connectors.base import KVConnector, KVConnectorOutput, Role
from kvserve.kv.grouped import GroupedKVCacheManager
from kvserve.kv.interface import KVManager
from kvserve.kv.layer_groups import LayerGroups
from kvserve.kv.manager import KVCacheManager, PrefixCacheStats
from kvserve.kv.ops import KVOps
from kvserve.sched.output import ModelRunnerOutput
from kvserve.sched.request import Request, RequestStatus, SamplingParams
from kvserve.sched.scheduler import Scheduler

BS = 4


class FakeKV:
    """Block tables as lists of fresh ids; a request's table grows to cover its computed
    tokens plus the new ones; free returns them. Nothing is cached or shared."""

    block_size = BS
    root = b"fake"
    write_through_hits = None
    num_groups = 1

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tables: dict[str, list[int]] = {}
        self.free_ids = list(range(num_blocks))
        self.stats = PrefixCacheStats()
        self.num_evictions = 0
        self.num_cached_free_blocks = 0
        self.freed: list[str] = []  # requests in the order their blocks were freed

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def allocate_slots(self, request, num_new_tokens, computed=(), compact_blocks=0) -> bool:
        table = self.tables.setdefault(request.request_id, [])
        need = -(-(request.num_computed_tokens + num_new_tokens) // BS) - len(table)
        if need > len(self.free_ids):
            if not table:
                del self.tables[request.request_id]
            return False
        for _ in range(max(need, 0)):
            table.append(self.free_ids.pop(0))
        return True

    def free(self, request) -> None:
        table = self.tables.pop(request.request_id, None)
        if table:
            self.free_ids += table
            self.freed.append(request.request_id)

    def block_ids(self, request) -> list[int]:
        return self.tables.get(request.request_id, [])

    def num_held_slots(self, request) -> int:
        return len(self.block_ids(request)) * BS

    def fork(self, parent, child) -> None:
        raise AssertionError("no n > 1 here")

    def get_computed_blocks(self, request, count=True):
        return [], 0

    def block_hashes(self, request):
        return []

    def count_hits(self, request, hit) -> None:
        pass

    def num_cached_prefix_blocks(self, request) -> int:
        return 0

    def cached_share(self, token_ids, cache_salt=None) -> float:
        return 0.0

    def cached_prefix(self, hashes):
        return []

    def group_block_ids(self, request):
        return ()

    def compact_block_ids(self, request):
        return []

    def apply_compaction(self, request) -> int:
        return 0

    def cache_computed_blocks(self, request, num_tokens=None) -> None:
        pass

    def drop_leading_blocks(self, request, first_kept, head=0) -> int:
        return 0

    def num_dropped_blocks(self, request) -> int:
        return 0

    def take_ops(self) -> KVOps:
        return KVOps()

    def restore_ops(self, ops) -> None:
        pass

    def enable_events(self, medium) -> None:
        pass

    def take_events(self):
        return []

    def tier_candidates(self, request, num_hit_blocks):
        return []

    def blocks_completed_by(self, request, num_new_tokens):
        return []

    def reset_prefix_cache(self) -> bool:
        return True

    def check_invariants(self) -> None:
        held = [b for t in self.tables.values() for b in t]
        assert len(held) == len(set(held)) and len(held) + len(self.free_ids) == self.num_blocks


def make(num_blocks=64, **cfg) -> tuple[Scheduler, FakeKV]:
    kv = FakeKV(num_blocks)
    return Scheduler(SchedulerConfig(**cfg), kv, max_model_len=1024), kv


def req(rid, prompt_len, max_tokens=4, priority=0) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(1, prompt_len + 1)), params, max_tokens, priority=priority)


def step(s: Scheduler, now: float = 0.0, report: KVConnectorOutput | None = None):
    """One step: every sampling row gets token 7. Returns the step's plain description."""
    so = s.schedule(now)
    ids = [rid for q in so.seqs for rid in q.sample_ids]
    out = ModelRunnerOutput(ids, [7] * len(ids), [None] * len(ids), kv_connector_output=report)
    s.update_from_output(so, out, now, now)
    s.kv.check_invariants()
    return so


def test_the_kv_managers_and_the_fake_implement_one_protocol():
    groups = LayerGroups.of((None, 8, None, 8))
    for kv in (KVCacheManager(16, BS), GroupedKVCacheManager(groups, 16, BS), FakeKV(16)):
        assert isinstance(kv, KVManager), type(kv).__name__


def test_chunked_prefill_stays_within_the_token_budget_and_decodes_first():
    s, _ = make(max_num_batched_tokens=10)
    s.add_request(req("a", 3))
    s.add_request(req("b", 25))
    so = step(s)
    assert [(q.req_id, q.num_tokens) for q in so.seqs] == [("a", 3), ("b", 7)]
    so = step(s)  # a decodes one token; b's prompt goes on with the rest of the budget
    assert [(q.req_id, q.num_tokens) for q in so.seqs] == [("a", 1), ("b", 9)]
    assert so.num_decode_tokens == 1 and so.num_prefill_tokens == 9
    so = step(s)
    assert [(q.req_id, q.num_tokens) for q in so.seqs] == [("a", 1), ("b", 9)]
    assert so.seqs[1].sample_ids == ("b",)  # b's prompt (7 + 9 + 9 = 25) is done: it samples


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    s, _ = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add_request(req("a", 6))
    s.add_request(req("b", 8))
    assert [(q.req_id, q.num_tokens) for q in step(s).seqs] == [("a", 6)]
    assert [(q.req_id, q.num_tokens) for q in step(s).seqs] == [("a", 1), ("b", 8)]


def test_when_blocks_run_out_the_newest_request_is_preempted_and_waits_first():
    # Three requests of 4-token prompts take a block each; each decode token past the block
    # needs another. 4 blocks: the third request's growth preempts the newest.
    s, kv = make(num_blocks=4)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 4, max_tokens=8))
    step(s)  # prompts: a, b, c one block each (1 left)
    so = step(s)  # a takes the last block; b cannot grow: c (the newest) is preempted
    assert so.preempted_req_ids == ["c"]
    assert kv.freed == ["c"]
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert s.waiting.order(kv)[0].request_id == "c"
    assert s.requests["c"].status == RequestStatus.PREEMPTED
    assert s.requests["c"].num_computed_tokens == 0
    assert s.stats.num_preemptions == 1


def test_priority_admits_lower_values_first_and_preempts_the_least_urgent():
    s, kv = make(num_blocks=4, scheduling_policy="priority", max_num_seqs=3)
    s.add_request(req("low", 4, max_tokens=8, priority=5))
    s.add_request(req("high", 4, max_tokens=8, priority=-1))
    s.add_request(req("mid", 4, max_tokens=8, priority=2))
    so = step(s)
    assert [q.req_id for q in so.seqs] == ["high", "mid", "low"]
    so = step(s)  # out of blocks: the least urgent (highest value) goes, not the newest
    assert so.preempted_req_ids == ["low"]
    assert [r.request_id for r in s.running] == ["high", "mid"]


class HoldingConnector(KVConnector):
    """Scheduler side only: holds every finished request's blocks."""

    def __init__(self) -> None:
        super().__init__(Role.SCHEDULER)
        self.finished: list[tuple[str, list[int]]] = []

    def request_finished(self, request, block_ids):
        self.finished.append((request.request_id, list(block_ids)))
        return True, {"peer": "x"}


def test_delay_free_holds_blocks_until_the_workers_report_them_sent():
    kv = FakeKV(16)
    conn = HoldingConnector()
    s = Scheduler(SchedulerConfig(), kv, max_model_len=1024, connector=conn)
    s.add_request(req("a", 6, max_tokens=2))
    step(s)
    step(s)  # the second token: a finishes
    assert s.requests == {} and "a" in s.held
    assert conn.finished == [("a", [0, 1])]
    assert s.held["a"][0].kv_transfer_params == {"peer": "x"}
    assert kv.tables == {"a": [0, 1]} and kv.freed == []  # still held
    assert s.awaits_workers
    step(s, report=KVConnectorOutput(finished_sending={"other"}))
    assert "a" in s.held  # another request's notice frees nothing
    step(s, report=KVConnectorOutput(finished_sending={"a"}))
    assert s.held == {} and kv.freed == ["a"] and kv.num_used_blocks == 0
    assert not s.awaits_workers


def test_a_hold_whose_lease_ends_is_freed():
    kv = FakeKV(16)
    conn = HoldingConnector()
    conn.lease_s = 10.0
    s = Scheduler(SchedulerConfig(), kv, max_model_len=1024, connector=conn)
    s.add_request(req("a", 6, max_tokens=1))
    step(s, now=1.0)
    assert "a" in s.held
    step(s, now=10.5)
    assert "a" in s.held
    step(s, now=11.5)  # held at 1.0 for 10 s
    assert s.held == {} and kv.freed == ["a"]
    assert s.stats.held_lease_expired == 1


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_every_prompt_token_is_scheduled_exactly_once(budget):
    s, _ = make(max_num_batched_tokens=budget)
    lens = {"a": 5, "b": 11, "c": 2}
    for rid, n in lens.items():
        s.add_request(req(rid, n, max_tokens=1))
    seen = dict.fromkeys(lens, 0)
    for _ in range(40):
        so = step(s)
        assert so.total_tokens <= budget
        for q in so.seqs:
            assert q.position == seen[q.req_id]  # chunks follow each other
            seen[q.req_id] += q.num_tokens
        if not s.requests:
            break
    assert seen == lens
