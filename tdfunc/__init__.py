"""tdfunc: an immutable, pytree-registered, compile-first TensorDict for PyTorch.

Example:
    >>> import torch, tdfunc
    >>> td = tdfunc.TensorDict(a=torch.ones(3, 2), b={"c": torch.zeros(3)}, batch_size=[3])
    >>> (td + 1)["b", "c"].tolist()
    [1.0, 1.0, 1.0]
"""

from . import nn, testing
from ._base import TensorTree
from ._export import dynamic_batch_shapes
from ._ops import (
    cat,
    empty_like,
    full_like,
    ones_like,
    stack,
    zeros_like,
)
from ._tree import OPTREE_NAMESPACE, is_node
from .control import cond, scan, while_loop
from .memmap import MemmapFormatError, MemoryMappedTensor, load, memmap_like, save
from .nn import from_module, functional_call, stack_modules
from ._tensorclass import is_tensorclass, tensorclass
from .tensordict import TensorDict, from_dict

__version__ = "0.1.0"


def __getattr__(name: str):
    # tdfunc.distributed imports torch.distributed.tensor (about 1 s): loaded on first use
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MemmapFormatError",
    "MemoryMappedTensor",
    "OPTREE_NAMESPACE",
    "TensorDict",
    "TensorTree",
    "cat",
    "cond",
    "dynamic_batch_shapes",
    "empty_like",
    "from_dict",
    "from_module",
    "full_like",
    "functional_call",
    "is_node",
    "is_tensorclass",
    "load",
    "memmap_like",
    "nn",
    "ones_like",
    "save",
    "scan",
    "stack",
    "stack_modules",
    "tensorclass",
    "testing",
    "while_loop",
    "zeros_like",
]
