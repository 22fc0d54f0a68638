"""tdfunc: an immutable, pytree-registered, compile-first TensorDict for PyTorch.

One home per public name: everything a program uses every day is imported from ``tdfunc``
itself; the subpackages hold only the names of their area that are not here
(``tdfunc.nn.TensorDictModule``, ``tdfunc.distributed.*``, ``tdfunc.testing.*``). A
*container* is a :class:`TensorDict` or a ``@tensorclass`` instance; :class:`Container` is
their common base class.

Example:
    >>> import torch, tdfunc
    >>> td = tdfunc.TensorDict(a=torch.ones(3, 2), b={"c": torch.zeros(3)}, batch_size=[3])
    >>> (td + 1)["b", "c"].tolist()
    [1.0, 1.0, 1.0]
"""

import importlib
from typing import Any

from . import _collate, _control, _deprecate, _migration, nn, optim, testing
from ._base import Container
from ._control import cond, scan, while_loop
from ._donate import DonatedError
from ._donate import compile as compile  # tdfunc.compile, as torch.compile
from ._errors import InPlaceError, KeysDifferError, NodeTypesDifferError, StructureError
from ._export import dynamic_batch_shapes
from ._grad import value_and_grad
from ._jagged._batch import as_jagged, collate_jagged, from_padded, to_padded
from ._jagged._layout import JaggedOpError
from ._jagged._sampler import LengthGroupedSampler
from ._nontensor import NonTensor
from ._ops import cat, empty_like, full_like, ones_like, stack, zeros_like
from ._ops._pad import pad, pad_sequence
from ._tensorclass import is_tensorclass, tensorclass
from ._tree import OPTREE_NAMESPACE
from ._tree import is_node as is_container
from ._version import __version__
from .interop._errors import SafetensorsFormatError
from .interop._safetensors import load_safetensors, save_safetensors
from .interop._tensordict import from_tensordict, to_tensordict
from .memmap._errors import MemmapFormatError, StoreCleanupWarning, StoreReplacedError
from .memmap._store import load, memmap_like, save
from .memmap._tensor import MemoryMappedTensor
from .memmap._write import write_at
from .nn._functional import from_module, functional_call, stack_modules, state_dict
from .tensordict import TensorDict

del _collate  # imported for its registration with torch's default_collate

_deprecated_getattr = _deprecate.module_getattr(
    __name__,
    {
        "TensorTree": (lambda: Container, "tdfunc.Container"),
        "is_node": (lambda: is_container, "tdfunc.is_container"),
        "from_dict": (lambda: TensorDict.from_dict, "tdfunc.TensorDict.from_dict"),
    },
    # a tensordict package-level name (tdfunc.lazy_stack...): the error names tdfunc's spelling
    missing=lambda name: _migration.module_error(__name__, name),
)
_deprecate.module_path(
    f"{__name__}.tensorclass",
    {
        "tensorclass": (lambda: tensorclass, "tdfunc.tensorclass"),
        "is_tensorclass": (lambda: is_tensorclass, "tdfunc.is_tensorclass"),
    },
)
_deprecate.module_path(
    f"{__name__}.control",
    {n: (_deprecate.attribute(_control, n), f"tdfunc.{n}") for n in ("cond", "while_loop", "scan")},
)


def __getattr__(name: str) -> Any:
    # tdfunc.distributed imports torch.distributed.tensor (about 1 s): loaded on first use
    if name == "distributed":
        return importlib.import_module(".distributed", __name__)
    return _deprecated_getattr(name)


def __dir__() -> list[str]:
    return [*__all__, "distributed"]


__all__ = [
    "OPTREE_NAMESPACE",
    "Container",
    "DonatedError",
    "InPlaceError",
    "JaggedOpError",
    "KeysDifferError",
    "LengthGroupedSampler",
    "MemmapFormatError",
    "MemoryMappedTensor",
    "NodeTypesDifferError",
    "NonTensor",
    "SafetensorsFormatError",
    "StoreCleanupWarning",
    "StoreReplacedError",
    "StructureError",
    "TensorDict",
    "__version__",
    "as_jagged",
    "cat",
    "collate_jagged",
    "compile",
    "cond",
    "dynamic_batch_shapes",
    "empty_like",
    "from_module",
    "from_padded",
    "from_tensordict",
    "full_like",
    "functional_call",
    "is_container",
    "is_tensorclass",
    "load",
    "load_safetensors",
    "memmap_like",
    "nn",
    "ones_like",
    "optim",
    "pad",
    "pad_sequence",
    "save",
    "save_safetensors",
    "scan",
    "stack",
    "stack_modules",
    "state_dict",
    "tensorclass",
    "testing",
    "to_padded",
    "to_tensordict",
    "value_and_grad",
    "while_loop",
    "write_at",
    "zeros_like",
]
