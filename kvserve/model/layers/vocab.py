"""The embedding table and the LM head split over tensor-parallel ranks by vocabulary rows.

The vocabulary is padded to a multiple of ``padding_size`` times the world size, so that
every rank holds the same number of rows (the padding rows are zero); with one rank and the
default ``padding_size`` of 1 nothing is padded, and the table and the head are the
checkpoint's matrices. vLLM pads to 64 rows for its GPU kernels; a padded head here also
changes which CPU kernel can take it (kvserve/kernels/amx.py packs multiples of 32), so the
padding is the caller's choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers.linear import copy_shard
from kvserve.model.layers.parallel_state import SINGLE_RANK, TensorParallelGroup
from kvserve.model.linear_ops import TorchOps


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, each rank holding the rows ``[vocab_start, vocab_start + rows)``: a
    rank looks up the ids in its range and writes zeros for the others, and the all-reduce
    sums the ranks' rows into every token's embedding."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TensorParallelGroup | None = None,
        params_dtype: torch.dtype | None = None,
        padding_size: int = 1,
    ) -> None:
        super().__init__()
        self.tp = tp or SINGLE_RANK
        ws = self.tp.world_size
        step = padding_size * ws
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = -(-num_embeddings // step) * step
        self.rows = self.num_embeddings_padded // ws
        self.vocab_start = self.tp.rank * self.rows
        self.embedding_dim = embedding_dim
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.rows, embedding_dim, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def _copy_rows(self, dst: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        """This rank's rows of the whole ``[num_embeddings, dim]`` table into ``dst``, the
        padding rows zero."""
        n = max(0, min(self.num_embeddings - self.vocab_start, self.rows))
        copy_shard(dst[:n], loaded_weight[self.vocab_start : self.vocab_start + n],
                   type(self).__name__)  # fmt: skip
        dst[n:].zero_()

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        self._copy_rows(param.data, loaded_weight)

    def _local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids`` as rows of this rank's shard (0 where another rank holds them) and the
        mask of those another rank holds."""
        local = ids - self.vocab_start
        other = (local < 0) | (local >= self.rows)
        return local.masked_fill(other, 0), other

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local, other = self._local_ids(ids)
        out = F.embedding(local, self.weight).masked_fill_(other.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, rows={self.rows}, dim={self.embedding_dim}, "
            f"rank={self.tp.rank}/{self.tp.world_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head: each rank computes the logits of its vocabulary rows through its backend
    (``ops``), and the ranks' logits are gathered into the whole vocabulary's (float32).

    ``weight_fp32``, where :meth:`keep_float32` made it, is this rank's rows in float32 beside
    a reduced-precision model, for the exact logits the sampler settles greedy near-ties with.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TensorParallelGroup | None = None,
        params_dtype: torch.dtype | None = None,
        padding_size: int = 1,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp, params_dtype, padding_size)
        self.gemm_names = ("head",)
        self.register_parameter("bias", None)  # the backends' linear reads one
        self.ops: TorchOps = TorchOps()
        self.weight_fp32: torch.Tensor | None = None
        self._gather = self.tp.world_size > 1
        self._trim = self.num_embeddings_padded != num_embeddings

    def tie_weights(self, embed: VocabParallelEmbedding) -> None:
        """Share the embedding table (``tie_word_embeddings``): the same rows on each rank."""
        self.weight = embed.weight

    def keep_float32(self, loaded_weight: torch.Tensor) -> None:
        """Keep this rank's rows of the whole head ``loaded_weight`` in float32."""
        w = torch.empty(self.rows, self.embedding_dim, dtype=torch.float32,
                        device=self.weight.device)  # fmt: skip
        self._copy_rows(w, loaded_weight)
        self.weight_fp32 = w

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[n, num_embeddings]`` of hidden rows ``[n, dim]``."""
        logits = self.ops.logits(hidden, self)
        if self._gather:
            logits = self.tp.all_gather(logits, -1)
        return logits[..., : self.num_embeddings] if self._trim else logits

    def exact_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits of ``token_ids`` ([n, k]) for hidden rows [n, dim], from
        ``weight_fp32`` (the weight itself where there is none)."""
        w = self.weight_fp32 if self.weight_fp32 is not None else self.weight
        if self.tp.world_size == 1:
            return torch.einsum("nkh,nh->nk", w[token_ids].float(), hidden.float())
        local, other = self._local_ids(token_ids)
        out = torch.einsum("nkh,nh->nk", w[local].float(), hidden.float())
        return self.tp.all_reduce(out.masked_fill_(other, 0))
