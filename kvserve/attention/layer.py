"""The attention a decoder layer calls, whichever backend computes it."""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.kv.storage import KVStorage


class Attention:
    """Paged attention of one decoder layer: its sliding window (None: full attention) and
    the backend that computes it, which the runner chooses for the whole model
    (:meth:`kvserve.model.llama.LlamaForCausalLM.set_attention_backend`). The model calls it
    with the layer's rotated q/k/v and never learns which backend runs.

    Not an ``nn.Module``: it holds no weights, and a module call's hook dispatch would cost
    a microsecond per layer per step."""

    __slots__ = ("backend", "window")

    def __init__(self, backend: AttentionBackend, window: int | None = None) -> None:
        self.backend = backend
        self.window = window

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        storage: KVStorage,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the step's K/V of ``layer`` into ``storage`` and attend: q [T, H, D], k/v
        [T, KVH, D] -> [T, H, D]. A layer-wise KV connector waits for the layer's loaded KV
        before, and saves the layer's KV after."""
        connector = meta.layer_connector
        if connector is None:
            return self.backend.forward(q, k, v, layer, storage, meta, self.window)
        connector.wait_for_layer_load(layer)
        out = self.backend.forward(q, k, v, layer, storage, meta, self.window)
        connector.save_kv_layer(layer)
        return out
