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

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

from . import _collate, nn, testing
from ._base import Container
from ._control import cond, scan, while_loop
from ._errors import KeysDifferError, NodeTypesDifferError, StructureError
from ._export import dynamic_batch_shapes
from ._ops import cat, empty_like, full_like, ones_like, stack, zeros_like
from ._tensorclass import is_tensorclass, tensorclass
from ._tree import OPTREE_NAMESPACE
from ._tree import is_node as is_container
from ._version import __version__
from .memmap import MemmapFormatError, MemoryMappedTensor, load, memmap_like, save
from .nn import from_module, functional_call, stack_modules
from .tensordict import TensorDict

del _collate  # imported for its registration with torch's default_collate

#: Names that moved, kept for one release: old name -> (object getter, new home).
_DEPRECATED: dict[str, tuple[str, str]] = {
    "TensorTree": ("Container", "tdfunc.Container"),
    "is_node": ("is_container", "tdfunc.is_container"),
    "from_dict": ("TensorDict.from_dict", "tdfunc.TensorDict.from_dict"),
}


def _deprecated_module(name: str, names: dict[str, Any], home: str) -> None:
    """Register ``tdfunc.<name>`` as an importable module path that still gives ``names``
    (with a ``DeprecationWarning``), without shadowing the attribute ``tdfunc.<name>``."""
    mod = types.ModuleType(f"{__name__}.{name}", f"Deprecated module path: use {home}.")

    def getattr_(attr: str) -> Any:
        if attr not in names:
            raise AttributeError(f"module {mod.__name__!r} has no attribute {attr!r}")
        warnings.warn(
            f"{mod.__name__}.{attr} is deprecated and will be removed in the next release; "
            f"use {home}",
            DeprecationWarning,
            stacklevel=2,
        )
        return names[attr]

    mod.__getattr__ = getattr_  # type: ignore[method-assign]
    sys.modules[mod.__name__] = mod


_deprecated_module(
    "tensorclass",
    {"tensorclass": tensorclass, "is_tensorclass": is_tensorclass},
    "tdfunc.tensorclass / tdfunc.is_tensorclass",
)
_deprecated_module(
    "control", {"cond": cond, "while_loop": while_loop, "scan": scan}, "tdfunc.cond / ..."
)


def __getattr__(name: str) -> Any:
    # tdfunc.distributed imports torch.distributed.tensor (about 1 s): loaded on first use
    if name == "distributed":
        return importlib.import_module(".distributed", __name__)
    if name in _DEPRECATED:
        target, home = _DEPRECATED[name]
        warnings.warn(
            f"tdfunc.{name} is deprecated and will be removed in the next release; use {home}",
            DeprecationWarning,
            stacklevel=2,
        )
        obj: Any = globals()[target.split(".")[0]]
        for part in target.split(".")[1:]:
            obj = getattr(obj, part)
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "OPTREE_NAMESPACE",
    "Container",
    "KeysDifferError",
    "MemmapFormatError",
    "MemoryMappedTensor",
    "NodeTypesDifferError",
    "StructureError",
    "TensorDict",
    "__version__",
    "cat",
    "cond",
    "dynamic_batch_shapes",
    "empty_like",
    "from_module",
    "full_like",
    "functional_call",
    "is_container",
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
