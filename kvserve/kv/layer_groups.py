"""Layer groups of a hybrid model: per-group block tables over one shared pool.

A hybrid checkpoint mixes full-attention layers with sliding-window layers (Qwen2's
``max_window_layers``, Gemma-2's alternation, ``layer_types``). With one block table for every
layer, a block can be returned to the pool only when *no* layer reads it any more, so the full
layers pin every block of the sequence and the window layers' share of the memory is never
given back. Here, as in vLLM's hybrid allocator, the layers are split into groups of equal
size ``n`` whose layers share a window (``n`` is the greatest common divisor of the counts of
each kind, so no group is padded); each group gets a block table of its own per request, and
every pool block holds ``n`` layers' K/V. The storage's per-layer tensors alias ``n`` *slot*
tensors: layer ``l`` lives in slot ``slot_of[l]``, and because a pool block belongs to one group
at a time, the layers of different groups that share a slot never meet in the same block. A
window group's blocks behind its window go back to the pool as the sequence advances; a full
group keeps its table, so the engine stays exact.

The engine counts memory in *model blocks* (``block_size`` tokens across every layer, the unit
of ``num_gpu_blocks`` and of ``kvserve plan``); the pool holds ``num_groups`` group blocks per
model block, the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """``windows[g]``: group ``g``'s sliding window (None: full attention); ``layers[g]``: its
    layers, in slot order. Full-attention groups come first, so group 0 holds every token
    whenever the model has a full-attention layer."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...]) -> LayerGroups | None:
        """The groups of a model with these per-layer windows, or None when one table serves
        every layer (all full attention, or one window everywhere: Mistral)."""
        kinds: dict[int | None, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            kinds.setdefault(w, []).append(layer)
        if len(kinds) < 2:
            return None
        n = math.gcd(*(len(v) for v in kinds.values()))
        order = sorted(kinds, key=lambda w: (w is not None, w or 0))
        windows, layers = [], []
        for w in order:
            members = kinds[w]
            for i in range(0, len(members), n):
                windows.append(w)
                layers.append(tuple(members[i : i + n]))
        return cls(tuple(windows), tuple(layers))

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def num_slots(self) -> int:
        """Layers per pool block."""
        return len(self.layers[0])

    @property
    def slot_of(self) -> tuple[int, ...]:
        """Each layer's slot (its position inside its group)."""
        return tuple(slot for _, slot in self._placement())

    @property
    def group_of(self) -> tuple[int, ...]:
        """Each layer's group."""
        return tuple(g for g, _ in self._placement())

    def _placement(self) -> list[tuple[int, int]]:
        """(group, slot) of each layer."""
        out = [(0, 0)] * sum(len(g) for g in self.layers)
        for g, members in enumerate(self.layers):
            for slot, layer in enumerate(members):
                out[layer] = (g, slot)
        return out


def engine_layer_groups(
    layer_windows: tuple[int | None, ...], kv_format: str, offload: bool, disabled: bool
) -> LayerGroups | None:
    """The groups the engine uses for a model, or None for one table over every layer: not a
    hybrid model, ``disable_hybrid_kv_cache_manager`` (vLLM's flag), offload tiers (their
    payloads name blocks by one hash chain), or a format that bounds its partially filled
    blocks (KIVI's residual, which per-group tables would multiply)."""
    from kvserve.kv.formats import storage_class

    if disabled or offload or hasattr(storage_class(kv_format), "partial_block_capacity"):
        return None
    return LayerGroups.of(layer_windows)
