"""Module integration: parameters as TensorDicts, functional calls, ensembles, key-routed modules."""

from ._functional import from_module, functional_call, stack_modules
from ._modules import TensorDictModule, TensorDictSequential

__all__ = [
    "TensorDictModule",
    "TensorDictSequential",
    "from_module",
    "functional_call",
    "stack_modules",
]
