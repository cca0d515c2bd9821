"""What the KV manager did to blocks during one scheduling step, as plain data.

The runner applies it to the storage (``offload`` exports first, then ``freed`` so a format
can reclaim side state of blocks nobody holds, ``copies`` and ``loads`` before the forward
pass); the offload tiers and metrics read the same record. Nothing outside
:mod:`kvserve.kv` needs to look inside the block pool to know what happened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.storage import BlockPayload


@dataclass(slots=True)
class KVOps:
    """Block operations since the previous record, in the order they happened per kind."""

    # request id -> blocks given to it (appended to its table or replacing a shared block)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    # copy-on-write (src, dst): the runner copies these before the forward pass
    copies: list[tuple[int, int]] = field(default_factory=list)
    # blocks whose last reference went: now free, or cached-free if they hold a prefix
    freed: list[int] = field(default_factory=list)
    # cached blocks handed out for new content, with the prefix hash they lost
    evicted: list[tuple[int, bytes]] = field(default_factory=list)
    # Offload tiers: evicted blocks the runner exports first, before this step overwrites
    # them (the scheduler fills it from ``evicted``); and per request, fresh blocks and the
    # verified payloads a tier load gives them, imported before the forward pass.
    offload: list[tuple[int, bytes]] = field(default_factory=list)
    # Write-through: blocks this step fills, exported after its forward pass.
    offload_after: list[tuple[int, bytes]] = field(default_factory=list)
    loads: dict[str, tuple[list[int], list[BlockPayload]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(
            self.new_blocks or self.copies or self.freed or self.evicted or self.offload
            or self.offload_after or self.loads
        )  # fmt: skip
