"""Key-routed modules: ``TensorDictModule`` / ``TensorDictSequential``, and the probabilistic
ones (``ProbabilisticTensorDictModule`` / ``ProbabilisticTensorDictSequential``).

The module integration functions live at the top level: ``tdfunc.from_module``,
``tdfunc.functional_call``, ``tdfunc.stack_modules`` (``tdfunc.nn.<name>`` is a deprecated
path for them, kept for one release).
"""

from .. import _deprecate
from . import _functional
from ._modules import TensorDictModule, TensorDictSequential
from ._probabilistic import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
)

__getattr__ = _deprecate.module_getattr(
    __name__,
    {
        name: (_deprecate.attribute(_functional, name), f"tdfunc.{name}")
        for name in ("from_module", "functional_call", "stack_modules")
    },
)

__all__ = [
    "InteractionType",
    "ProbabilisticTensorDictModule",
    "ProbabilisticTensorDictSequential",
    "TensorDictModule",
    "TensorDictSequential",
]
