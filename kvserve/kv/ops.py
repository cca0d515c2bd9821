"""What the KV manager did to blocks during one scheduling step, as plain data.

The runner applies it to the storage (``freed`` so a format can reclaim side state of blocks
nobody holds, then ``copies``, before the forward pass); the KV connectors read the same
record (evicted cached blocks, before they are overwritten; blocks a write policy wants
stored). Nothing outside :mod:`kvserve.kv` needs to look inside the block pool to know what
happened. It holds block ids and hashes, never bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class KVOps:
    """Block operations since the previous record, in the order they happened per kind."""

    # request id -> blocks given to it (appended to its table or replacing a shared block)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    # copy-on-write (src, dst): the runner copies these before the forward pass
    copies: list[tuple[int, int]] = field(default_factory=list)
    # blocks whose last reference went: now free, or cached-free if they hold a prefix
    freed: list[int] = field(default_factory=list)
    # cached blocks handed out for new content, with the prefix hash they lost; the first
    # ``num_restored_evictions`` are a failed step's, given back (that step may have
    # written them)
    evicted: list[tuple[int, bytes]] = field(default_factory=list)
    num_restored_evictions: int = 0
    # cached blocks that reached the write-through hit count, still holding that hash
    hot: list[tuple[int, bytes]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.new_blocks or self.copies or self.freed or self.evicted or self.hot)
