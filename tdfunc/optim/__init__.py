"""Pure optimizers over containers: ``state = opt.init(params)``,
``updates, state = opt.update(grads, state, params)``, ``params = apply_updates(params, updates)``.

Nothing is written in place (not the params, the grads or the state); the state is a
:class:`~tdfunc.TensorDict` that saves with :func:`tdfunc.save` / :func:`tdfunc.save_safetensors`.
The optimizers follow ``torch.optim`` (options, defaults, formulas); transformations compose
with :func:`chain`, :func:`masked` and :func:`multi_transform`. Eager updates make one
``torch._foreach_*`` call per op over all leaves (per leaf under ``torch.vmap``); compiled
with ``torch.compile(fullgraph=True)`` they trace into one graph. Hyperparameters given as
tensors live in the state: changing them never recompiles, and under ``torch.vmap`` over an
ensemble each member has its own.

Example:
    >>> import torch, tdfunc
    >>> from tdfunc import optim
    >>> params = tdfunc.TensorDict(w=torch.ones(3), b=torch.zeros(1))
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-2))
    >>> state = opt.init(params)
    >>> grads = params * 2
    >>> updates, state = opt.update(grads, state, params)
    >>> params = optim.apply_updates(params, updates)
    >>> params["w"].shape, int(state["chain", "1", "adamw", "step"])
    (torch.Size([3]), 1)
"""

from ._core import GradientTransformation, Hyper, Schedule, apply_updates, set_hyperparams
from ._errors import OptimStateError
from ._optimizers import adagrad, adam, adamw, lion, rmsprop, sgd
from ._schedules import (
    constant,
    cosine_decay,
    join_schedules,
    linear,
    linear_warmup,
    step_decay,
    warmup_cosine_decay,
)
from ._step import step
from ._transforms import (
    Mask,
    add_decayed_weights,
    chain,
    clip_by_global_norm,
    masked,
    multi_transform,
    scale,
    scale_by_schedule,
    set_to_zero,
)

__all__ = [
    "GradientTransformation",
    "Hyper",
    "Mask",
    "OptimStateError",
    "Schedule",
    "adagrad",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "join_schedules",
    "linear",
    "linear_warmup",
    "lion",
    "masked",
    "multi_transform",
    "rmsprop",
    "scale",
    "scale_by_schedule",
    "set_hyperparams",
    "set_to_zero",
    "sgd",
    "step",
    "step_decay",
    "warmup_cosine_decay",
]
