"""tdfunc: an immutable, pytree-registered, compile-first TensorDict for PyTorch.

Example:
    >>> import torch, tdfunc
    >>> td = tdfunc.TensorDict(a=torch.ones(3, 2), b={"c": torch.zeros(3)}, batch_size=[3])
    >>> (td + 1)["b", "c"].tolist()
    [1.0, 1.0, 1.0]
"""

from . import testing
from ._base import TensorTree
from ._ops import (
    cat,
    empty_like,
    full_like,
    ones_like,
    stack,
    zeros_like,
)
from ._tree import OPTREE_NAMESPACE, is_node
from .memmap import MemmapFormatError, MemoryMappedTensor, load, memmap_like, save
from .tensorclass import is_tensorclass, tensorclass
from .tensordict import TensorDict, from_dict

__version__ = "0.1.0"

__all__ = [
    "MemmapFormatError",
    "MemoryMappedTensor",
    "OPTREE_NAMESPACE",
    "TensorDict",
    "TensorTree",
    "cat",
    "empty_like",
    "from_dict",
    "full_like",
    "is_node",
    "is_tensorclass",
    "load",
    "memmap_like",
    "ones_like",
    "save",
    "stack",
    "tensorclass",
    "testing",
    "zeros_like",
]
