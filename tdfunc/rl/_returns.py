"""Returns and advantages over a rollout: :func:`gae` (generalized advantage estimation) and
:func:`td_lambda_return` (TD(λ) returns), read from and written into containers by key.

Both follow torchrl's functional estimators (``generalized_advantage_estimate`` and
``td_lambda_return_estimate``) and its value-estimator modules' keys: the value of a step
under ``"state_value"``, the next value, reward and flags under ``"next"``. A
*terminated* step (the environment reached a terminal state) zeroes the bootstrap from the
next value; a *done* step (terminated or truncated: the episode ended, for whatever reason)
cuts the trace, so nothing flows back over an episode boundary. Without a terminated flag,
done stands for it (torchrl's default).

Each estimator is a reverse linear recurrence ``y[t] = x[t] + c[t] * y[t + 1]`` along the
time dim, computed by doubling (``ceil(log2(T))`` rounds of shifted multiply-adds over the
whole rollout, no loop over steps): the same values as the step-by-step loop to float
rounding, one small graph under ``torch.compile(fullgraph=True)`` whatever ``T``, and
plain tensor ops under ``torch.vmap`` and autograd.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._keys import ABSENT, as_path, fmt_key, get_path
from .._tree import KeyPath, is_node
from ._episodes import NOT_A_CONTAINER, read_flag

Key = str | tuple[str, ...]

NO_BATCH = "{fn}: the rollout has batch_size (); it needs a time dim (batch_size (T,) or (N, T))"
BAD_TIME_DIM = "{fn}: time_dim={time_dim} is not a batch dim of batch_size {batch}"
VALUE_MISSING = "{fn}: no {what} at key {key} (keys of the rollout: {available})"
VALUE_NOT_TENSOR = "{fn}: the {what} at key {key} is a {typ}, not a tensor"
VALUE_DTYPE = "{fn}: the {what} at key {key} has dtype {dtype}; it must be a floating-point tensor"
VALUE_SHAPE = (
    "{fn}: the {what} at key {key} has shape {shape}, the {ref_what} at key {ref_key} {ref}; "
    "rewards and values have one shape"
)
NO_FLAG = (
    "{fn}: done_key is None and no terminated flag at key {key}: the estimator needs a done "
    "or a terminated flag"
)
BAD_COEFF = "{fn}: {name} must be a float or a floating-point tensor, got {typ}"


def _read_value(node: Any, path: KeyPath, what: str, fn: str) -> Tensor:
    value = get_path(node, path, ABSENT)
    if value is ABSENT:
        raise KeyError(
            VALUE_MISSING.format(
                fn=fn, what=what, key=fmt_key(path), available=list(node._tdf_keys())
            )
        )
    if not isinstance(value, Tensor):
        raise TypeError(
            VALUE_NOT_TENSOR.format(fn=fn, what=what, key=fmt_key(path), typ=type(value).__name__)
        )
    if not value.is_floating_point():
        raise TypeError(VALUE_DTYPE.format(fn=fn, what=what, key=fmt_key(path), dtype=value.dtype))
    return value


def _coeff(x: Any, name: str, fn: str) -> Any:
    if isinstance(x, Tensor) and x.is_floating_point():
        return x
    if isinstance(x, (float, int)) and not isinstance(x, bool):
        return float(x)
    raise TypeError(BAD_COEFF.format(fn=fn, name=name, typ=type(x).__name__))


def _inputs(
    fn: str,
    td: Any,
    time_dim: int,
    named: list[tuple[str, Key]],
    done_key: Key | None,
    terminated_key: Key | None,
    truncated_key: Key | None,
) -> tuple[int, list[Tensor], Tensor, Tensor]:
    """The time dim, the value tensors (``named``: what and key, one shape), the flag that
    cuts the trace and the one that zeroes the bootstrap (shaped to broadcast with them)."""
    if not is_node(td):
        raise TypeError(NOT_A_CONTAINER.format(fn=fn, typ=type(td).__name__))
    batch = td._batch_size
    nb = len(batch)
    if nb == 0:
        raise ValueError(NO_BATCH.format(fn=fn))
    if not isinstance(time_dim, int) or isinstance(time_dim, bool) or not -nb <= time_dim < nb:
        raise ValueError(BAD_TIME_DIM.format(fn=fn, time_dim=time_dim, batch=tuple(batch)))
    paths = [(what, as_path(k)) for what, k in named]
    values = [_read_value(td, p, what, fn) for what, p in paths]
    for (what, p), v in zip(paths[1:], values[1:]):
        if v.shape != values[0].shape:
            raise ValueError(
                VALUE_SHAPE.format(
                    fn=fn,
                    what=what,
                    key=fmt_key(p),
                    shape=tuple(v.shape),
                    ref_what=paths[0][0],
                    ref_key=fmt_key(paths[0][1]),
                    ref=tuple(values[0].shape),
                )
            )
    done = None if done_key is None else read_flag(td, as_path(done_key), fn)
    terminated = None
    if terminated_key is not None:
        tpath = as_path(terminated_key)
        if get_path(td, tpath, ABSENT) is not ABSENT:
            terminated = read_flag(td, tpath, fn)
    if done is None and terminated is None:
        raise KeyError(NO_FLAG.format(fn=fn, key=fmt_key(as_path(terminated_key or "terminated"))))
    cut = done if done is not None else terminated
    assert cut is not None
    if terminated is not None:
        cut = cut | terminated
    if truncated_key is not None:
        cut = cut | read_flag(td, as_path(truncated_key), fn)
    stop = terminated if terminated is not None else cut
    extra = (1,) * (values[0].ndim - nb)
    return time_dim % nb, values, cut.reshape(*batch, *extra), stop.reshape(*batch, *extra)


def reverse_recurrence(x: Tensor, c: Tensor, dim: int) -> Tensor:
    """``y`` with ``y[t] = x[t] + c[t] * y[t + 1]`` along ``dim`` (``y`` past the end is 0),
    by doubling: after round ``k`` each ``y[t]`` sums the terms ``t .. t + 2**k - 1`` and
    ``c`` holds the product of the coefficients over that span.

    Example:
        >>> import torch
        >>> reverse_recurrence(torch.ones(4), torch.full((4,), 0.5), 0).tolist()
        [1.875, 1.75, 1.5, 1.0]
    """
    y = x.movedim(dim, 0)
    a = c.movedim(dim, 0)
    n = y.shape[0]
    span = 1
    while span < n:
        y = y + a * torch.cat([y[span:], torch.zeros_like(y[:span])])
        if span * 2 < n:
            a = a * torch.cat([a[span:], torch.zeros_like(a[:span])])
        span *= 2
    return y.movedim(0, dim)


def gae(
    td: Any,
    *,
    gamma: float | Tensor,
    lmbda: float | Tensor,
    time_dim: int = -1,
    value_key: Key = "state_value",
    next_value_key: Key = ("next", "state_value"),
    reward_key: Key = ("next", "reward"),
    done_key: Key | None = ("next", "done"),
    terminated_key: Key | None = ("next", "terminated"),
    truncated_key: Key | None = None,
    advantage_key: Key = "advantage",
    value_target_key: Key = "value_target",
) -> Any:
    """Generalized advantage estimation over a rollout: ``td`` plus the advantage and the
    value target (a new container; ``td`` is not modified).

    With ``delta[t] = reward[t] + gamma * (1 - terminated[t]) * next_value[t] - value[t]``,
    ``advantage[t] = delta[t] + gamma * lmbda * (1 - done[t]) * advantage[t + 1]`` (the
    last step has no successor) and ``value_target = advantage + value``: torchrl's
    ``generalized_advantage_estimate`` and its ``GAE`` module's keys.

    Args:
        td: the rollout, a TensorDict or tensorclass whose batch has a time dim.
        gamma: the discount (a float, or a tensor broadcasting with the values: one per
            step, or a 0-d tensor so that a new value does not recompile).
        lmbda: the λ of the trace, as ``gamma``.
        time_dim: the batch dim that is time (default the last, as torchrl).
        value_key: the value of each step.
        next_value_key: the value of the next state.
        reward_key: the reward of each step.
        done_key: the flag that ends an episode (cuts the trace), or ``None`` to use
            terminated (or truncated).
        terminated_key: the flag of a terminal state (zeroes the bootstrap and cuts the
            trace); where the rollout has no such entry (or ``None``), done stands for it.
        truncated_key: a flag that cuts the trace but keeps the bootstrap (when the done
            flag does not already include it).
        advantage_key: where the advantage is written.
        value_target_key: where the value target is written.

    Flags are bool tensors of the batch shape (or with a trailing dim of 1); the reward and
    both values are floating-point tensors of one shape (the batch shape plus feature dims).

    Returns:
        A container of ``td``'s type with ``advantage_key`` and ``value_target_key``.

    Raises:
        KeyError: a key is missing (the message names it).
        TypeError: a flag is not bool, a value not floating-point, ``gamma`` / ``lmbda`` not
            a number or a floating-point tensor.
        ValueError: no time dim or ``time_dim`` out of range; values of different shapes or a
            flag of another shape (naming the key).

    Example:
        >>> import torch, tdfunc, tdfunc.rl
        >>> td = tdfunc.TensorDict(
        ...     state_value=torch.zeros(1, 3),
        ...     next={"reward": torch.ones(1, 3), "state_value": torch.zeros(1, 3),
        ...           "done": torch.tensor([[False, True, False]])},
        ...     batch_size=[1, 3])
        >>> tdfunc.rl.gae(td, gamma=0.5, lmbda=1.0)["advantage"].tolist()
        [[1.5, 1.0, 1.0]]
    """
    fn = "gae"
    g, lm = _coeff(gamma, "gamma", fn), _coeff(lmbda, "lmbda", fn)
    t, (value, next_value, reward), cut, stop = _inputs(
        fn,
        td,
        time_dim,
        [("value", value_key), ("next value", next_value_key), ("reward", reward_key)],
        done_key,
        terminated_key,
        truncated_key,
    )
    delta = reward + g * torch.where(stop, 0.0, next_value) - value
    advantage = reverse_recurrence(delta, torch.where(cut, 0.0, g * lm * torch.ones_like(delta)), t)
    return td.set(advantage_key, advantage).set(value_target_key, advantage + value)


def td_lambda_return(
    td: Any,
    *,
    gamma: float | Tensor,
    lmbda: float | Tensor,
    time_dim: int = -1,
    value_key: Key = "state_value",
    next_value_key: Key = ("next", "state_value"),
    reward_key: Key = ("next", "reward"),
    done_key: Key | None = ("next", "done"),
    terminated_key: Key | None = ("next", "terminated"),
    truncated_key: Key | None = None,
    advantage_key: Key | None = "advantage",
    value_target_key: Key = "value_target",
) -> Any:
    """TD(λ) returns over a rollout: ``td`` plus the return (the value target) and the
    advantage ``return - value`` (a new container; ``td`` is not modified).

    ``G[t] = reward[t] + gamma * ((1 - lmbda) * v[t] + lmbda * G[t + 1])`` with ``v`` the
    next value zeroed where terminated, and ``G[t + 1]`` replaced by ``v[t]`` where done and
    at the last step: torchrl's ``td_lambda_return_estimate`` (with a per-step ``gamma`` /
    ``lmbda`` tensor, its ``rolling_gamma=True``) and its ``TDLambdaEstimator`` module's
    keys.

    Args:
        td: the rollout, a TensorDict or tensorclass whose batch has a time dim.
        gamma: the discount (a float, or a tensor broadcasting with the values).
        lmbda: the λ of the return, as ``gamma``.
        time_dim: the batch dim that is time (default the last, as torchrl).
        value_key: the value of each step (read only for the advantage).
        next_value_key: the value of the next state.
        reward_key: the reward of each step.
        done_key: the flag that ends an episode, or ``None`` to use terminated (or
            truncated).
        terminated_key: the flag of a terminal state; where the rollout has no such entry
            (or ``None``), done stands for it.
        truncated_key: a flag that cuts the return but keeps the bootstrap.
        advantage_key: where ``return - value`` is written; ``None``: not written (and the
            value is not read).
        value_target_key: where the return is written.

    Returns:
        A container of ``td``'s type with ``value_target_key`` (and ``advantage_key``).

    Raises:
        KeyError: a key is missing (the message names it).
        TypeError: a flag is not bool, a value not floating-point, ``gamma`` / ``lmbda`` not
            a number or a floating-point tensor.
        ValueError: no time dim or ``time_dim`` out of range; values of different shapes or a
            flag of another shape (naming the key).

    Example:
        >>> import torch, tdfunc, tdfunc.rl
        >>> td = tdfunc.TensorDict(
        ...     next={"reward": torch.ones(3), "state_value": torch.full((3,), 2.0),
        ...           "done": torch.tensor([False, False, False])},
        ...     batch_size=[3])
        >>> out = tdfunc.rl.td_lambda_return(td, gamma=0.5, lmbda=0.5, advantage_key=None)
        >>> out["value_target"].tolist()
        [2.0, 2.0, 2.0]
    """
    fn = "td_lambda_return"
    g, lm = _coeff(gamma, "gamma", fn), _coeff(lmbda, "lmbda", fn)
    named = [("next value", next_value_key), ("reward", reward_key)]
    if advantage_key is not None:
        named.append(("value", value_key))
    t, values, cut, stop = _inputs(fn, td, time_dim, named, done_key, terminated_key, truncated_key)
    next_value, reward = values[0], values[1]
    v = torch.where(stop, 0.0, next_value)
    # the last step bootstraps from its next value, as a done step does
    n = cut.shape[t]
    last = torch.arange(n, device=cut.device) == n - 1
    last = last.reshape((n,) + (1,) * (cut.ndim - t - 1))
    end = cut | last
    gl = g * lm * torch.ones_like(reward)
    x = reward + g * (1 - lm) * v + torch.where(end, gl * v, 0.0)
    returns = reverse_recurrence(x, torch.where(end, 0.0, gl), t)
    out = td.set(value_target_key, returns)
    if advantage_key is not None:
        out = out.set(advantage_key, returns - values[2])
    return out


__all__ = ["gae", "td_lambda_return"]
