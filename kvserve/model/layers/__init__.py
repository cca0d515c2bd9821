"""The model's parallel building blocks: linear layers, the vocabulary-parallel embedding and
LM head, and the MLP, each holding its tensor-parallel shard and its compute backend."""

from torch import nn

from kvserve.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from kvserve.model.layers.mlp import MLP
from kvserve.model.layers.parallel_state import (
    SINGLE_RANK,
    Communicator,
    TensorParallelGroup,
    check_tensor_parallel,
    kv_head_split,
)
from kvserve.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.linear_ops import TorchOps

# The modules that compute through a linear backend: each gets the model's when it is chosen.
BACKEND_MODULES = (LinearBase, MLP, ParallelLMHead)


def set_linear_ops(module: nn.Module, ops: TorchOps) -> None:
    """Make ``ops`` the backend of every linear module, MLP and LM head in ``module`` (a model
    or one layer), after it laid their matrices out for itself."""
    ops.adopt(module)
    for m in module.modules():
        if isinstance(m, BACKEND_MODULES):
            m.ops = ops


__all__ = [
    "BACKEND_MODULES",
    "MLP",
    "SINGLE_RANK",
    "ColumnParallelLinear",
    "Communicator",
    "LinearBase",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "TensorParallelGroup",
    "VocabParallelEmbedding",
    "check_tensor_parallel",
    "default_weight_loader",
    "kv_head_split",
    "set_linear_ops",
]
