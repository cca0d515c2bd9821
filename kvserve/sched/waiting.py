"""The waiting queue: requests not running, and the order the scheduler considers them in.

Requests sit in arrival order (a preempted one goes back to the front: it was admitted before
everything behind it). Each step the scheduler walks :meth:`WaitingQueue.order`:

- ``fcfs``: queue order;
- ``priority``: vLLM's ``priority`` (lower first), queue order among equals;
- ``lpm``: the longest cached prefix first (fewest tokens to compute), queue order among equals.

Any policy that lets a request jump ahead (priority, lpm, projected admission trying a smaller
request when the next one does not fit yet) counts a skip against every request it passes;
a request passed over ``max_skips`` times is considered first, before the policy's order, and
admission waits for it. That bounds starvation: a low-priority request waits at most
``max_skips`` admissions of others, plus the time for its blocks to free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.sched.request import Request


class WaitingQueue:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config  # read each step: its policy and lpm_max_skips
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def __contains__(self, req: Request) -> bool:
        return req in self._q

    def append(self, req: Request) -> None:
        self._q.append(req)

    def appendleft(self, req: Request) -> None:
        self._q.appendleft(req)

    def extendleft(self, reqs: Iterable[Request]) -> None:
        self._q.extendleft(reqs)

    def remove(self, req: Request) -> None:
        """Raises ValueError if ``req`` is not waiting."""
        if self._q and self._q[0] is req:
            self._q.popleft()
        else:
            self._q.remove(req)

    def order(self, kv: KVCacheManager) -> list[Request]:
        """This step's candidates (requests loading from a tier left out), in the order to
        try them: the starving first, then the policy's order."""
        ready = [r for r in self._q if not r.loading]
        if len(ready) <= 1:
            return ready
        policy = self.config.scheduling_policy
        starving = [r for r in ready if r.skips >= self.config.lpm_max_skips]
        if policy == "priority":
            rest = sorted(ready, key=lambda r: r.priority)  # stable: queue order among equals
        elif policy == "lpm":
            hits = {id(r): kv.num_cached_prefix_blocks(r) for r in ready}
            rest = sorted(ready, key=lambda r: -hits[id(r)])
        else:
            rest = ready
        if not starving:
            return rest
        first = {id(r) for r in starving}
        return starving + [r for r in rest if id(r) not in first]

    def passed_over(self, admitted: Request, exempt: Iterable[Request] = ()) -> None:
        """``admitted`` was admitted: count a skip against every ready request ahead of it in
        the queue (``exempt``: ones held back on purpose this step)."""
        held = {id(r) for r in exempt}
        for r in self._q:
            if r is admitted:
                return
            if not r.loading and id(r) not in held:
                r.skips += 1
