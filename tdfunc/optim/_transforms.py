"""Composable gradient transformations: ``chain``, ``clip_by_global_norm``,
``add_decayed_weights``, ``scale`` / ``scale_by_schedule``, ``set_to_zero``, ``masked`` and
``multi_transform``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import foreach_norm
from .._tree import KeyPath, leaves, leaves_with_paths, map_leaves
from ..tensordict import TensorDict
from . import _errors as E
from ._core import (
    GradientTransformation,
    Hyper,
    Lists,
    Mask,
    build,
    check_container,
    check_hyper,
    check_selection,
    fmt_path,
    glob_match,
    grads_and_params,
    is_zero,
    make_state,
    new_state,
    open_state,
    selector,
)
from ._step import fused_of


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other: each one's updates are the next one's grads.

    The state holds one entry per transformation, ``"0"``, ``"1"``, ... under ``"chain"``.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.chain(optim.add_decayed_weights(0.1), optim.sgd(lr=1.0))
        >>> p = tdfunc.TensorDict(w=torch.ones(1))
        >>> u, s = opt.update(p * 0, opt.init(p), p)
        >>> [round(x, 4) for x in u["w"].tolist()], list(s["chain"].keys())
        ([-0.1], ['0', '1'])
    """
    for t in transforms:
        if not isinstance(t, GradientTransformation):
            raise TypeError(E.NOT_A_TRANSFORMATION.format(what="chain", typ=type(t).__name__))
    names = [str(i) for i in range(len(transforms))]
    what = "chain.update"

    def init(params: Any) -> Any:
        check_container(params, "chain.init")
        return make_state(
            "chain", {n: t.init(params) for n, t in zip(names, transforms)}, params._batch_size
        )

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        check_container(grads, what)
        inner = open_state(state, "chain", names, grads, what)
        new: dict[str, Any] = {}
        for n, t in zip(names, transforms):
            grads, new[n] = t.update(grads, inner._tdf_get(n, None), params)
        return grads, new_state(state, "chain", new)

    last = fused_of(transforms[-1]) if transforms else None
    if last is not None:
        run_last = last

        def fused_step(grads: Any, state: Any, params: Any, donate: bool) -> Any:
            # the others' updates, then the last one's fused step
            check_container(grads, what)
            inner = open_state(state, "chain", names, grads, what)
            new: dict[str, Any] = {}
            for n, t in zip(names[:-1], transforms[:-1]):
                grads, new[n] = t.update(grads, inner._tdf_get(n, None), params)
            out = run_last(grads, inner._tdf_get(names[-1], None), params, donate)
            if out is None:
                return None
            params, new[names[-1]] = out
            return params, new_state(state, "chain", new)

        update.fused = fused_step  # type: ignore[attr-defined]  # read by optim.step
    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the grads so that their global L2 norm is at most ``max_norm``.

    The same formula as ``torch.nn.utils.clip_grad_norm_``: the factor is
    ``min(1, max_norm / (norm + 1e-6))``. With a batch of ensemble members (stacked params,
    or under ``torch.vmap``) each member's norm is its own. DTensor leaves reduce across
    ranks (``torch._foreach_norm`` gives partial norms that DTensor sums).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.clip_by_global_norm(1.0)
        >>> g = tdfunc.TensorDict(a=torch.tensor([3.0]), b=torch.tensor([4.0]))
        >>> u, _ = opt.update(g, opt.init(g))
        >>> [round(x, 4) for x in (u["a"].item(), u["b"].item())]
        [0.6, 0.8]
    """
    check_hyper("clip_by_global_norm", "max_norm", max_norm)
    max_norm = float(max_norm)

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Any,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        if not g:
            return [], {}
        if L.fe:
            total = torch.linalg.vector_norm(torch.stack(list(foreach_norm(g))))
        else:
            # one norm per member: reduce the feature dims only (under vmap there are none
            # left of the batch: each member is reduced on its own)
            bd = L.bd
            norms = [torch.linalg.vector_norm(x.reshape(*x.shape[:bd], -1), dim=-1) for x in g]
            total = torch.linalg.vector_norm(torch.stack(norms, dim=-1), dim=-1)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return L.mul(g, coef), {}

    return build("clip_by_global_norm", {}, {}, False, math, with_step=False)


def add_decayed_weights(weight_decay: Hyper = 0.0) -> GradientTransformation:
    """Add ``weight_decay * params`` to the grads (L2 regularisation as a transformation).

    Chained before an optimizer it gives torch.optim's ``weight_decay`` option; combine with
    :func:`masked` to leave biases and norms out. ``weight_decay`` may be a tensor (kept in
    the state, one value per ensemble member allowed) or a schedule.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.add_decayed_weights(0.5)
        >>> p = tdfunc.TensorDict(w=torch.ones(2))
        >>> u, _ = opt.update(p * 0, opt.init(p), p)
        >>> u["w"].tolist()
        [0.5, 0.5]
    """
    check_hyper("add_decayed_weights", "weight_decay", weight_decay)
    scheduled = callable(weight_decay) and not isinstance(weight_decay, Tensor)

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Any,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        assert p is not None
        return L.add(g, p, alpha=h["weight_decay"]), {}

    return build(
        "add_decayed_weights",
        {},
        {"weight_decay": weight_decay},
        not is_zero(weight_decay),
        math if not is_zero(weight_decay) else _identity,
        with_step=scheduled,
    )


def _identity(
    L: Lists, g: list[Tensor], p: Any, bufs: Any, count: Any, h: Any
) -> tuple[list[Tensor], dict[str, Any]]:
    return list(g), {}


def scale(step_size: Hyper) -> GradientTransformation:
    """Multiply the grads by ``step_size`` (a number, a tensor kept in the state, or a
    schedule of the step count, which the state then holds).

    ``chain(scale_by_something, scale(-lr))`` is the optax way of writing an optimizer.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.scale(-0.5)
        >>> g = tdfunc.TensorDict(w=torch.ones(2))
        >>> opt.update(g, opt.init(g))[0]["w"].tolist()
        [-0.5, -0.5]
    """
    if not callable(step_size) and not isinstance(step_size, (int, float, Tensor)):
        raise TypeError(
            E.BAD_SCALE.format(
                what="scale", expected="a number, a tensor or a schedule", value=step_size
            )
        )
    scheduled = callable(step_size) and not isinstance(step_size, Tensor)

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Any,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        return L.mul(g, h["step_size"]), {}

    return build("scale", {}, {"step_size": step_size}, False, math, with_step=scheduled)


def scale_by_schedule(schedule: Callable[[Tensor], Tensor]) -> GradientTransformation:
    """Multiply the grads by ``schedule(count)``; the count of updates lives in the state.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.scale_by_schedule(optim.step_decay(1.0, step_size=1, gamma=0.5))
        >>> g = tdfunc.TensorDict(w=torch.ones(1))
        >>> s = opt.init(g)
        >>> u0, s = opt.update(g, s)
        >>> u1, s = opt.update(g, s)
        >>> u0["w"].item(), u1["w"].item(), int(s["scale", "step"])
        (1.0, 0.5, 2)
    """
    if not callable(schedule):
        raise TypeError(
            E.BAD_SCALE.format(what="scale_by_schedule", expected="a schedule", value=schedule)
        )
    return scale(schedule)


def set_to_zero() -> GradientTransformation:
    """Zero updates (freeze): e.g. the label of frozen leaves in :func:`multi_transform`.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> g = tdfunc.TensorDict(w=torch.ones(2))
        >>> optim.set_to_zero().update(g, optim.set_to_zero().init(g))[0]["w"].tolist()
        [0.0, 0.0]
    """

    def math(
        L: Lists, g: list[Tensor], p: Any, bufs: Any, count: Any, h: Any
    ) -> tuple[list[Tensor], dict[str, Any]]:
        return [torch.zeros_like(x) for x in g], {}

    return build("set_to_zero", {}, {}, False, math, with_step=False)


# --------------------------------------------------------------------------------------
# selecting leaves
# --------------------------------------------------------------------------------------
def _nest(pairs: Sequence[tuple[KeyPath, Tensor]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, x in pairs:
        d = out
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = x
    return out


def _subset(node: Any, picks: list[int], pairs: list[tuple[KeyPath, Tensor]]) -> TensorDict:
    """The leaves at positions ``picks`` of ``node`` as a TensorDict (same key paths)."""
    return TensorDict(_nest([pairs[i] for i in picks]), batch_size=node._batch_size)


def _labels_of(
    node: Any, label: Callable[[KeyPath, Tensor], Any]
) -> tuple[list[Any], list[tuple[KeyPath, Tensor]]]:
    pairs = leaves_with_paths(node)
    return [label(path, x) for path, x in pairs], pairs


def _split(
    grads: Any, params: Any, label: Callable[[KeyPath, Tensor], Any], names: Sequence[Any]
) -> dict[Any, tuple[list[int], TensorDict, TensorDict | None]]:
    """Per label: positions of its leaves, the grads' subset and the params' subset."""
    labels, pairs = _labels_of(grads, label)
    ppairs = leaves_with_paths(params) if params is not None else None
    out = {}
    for n in names:
        picks = [i for i, lab in enumerate(labels) if lab == n]
        out[n] = (
            picks,
            _subset(grads, picks, pairs),
            None if ppairs is None else _subset(params, picks, ppairs),
        )
    return out


def _merge(grads: Any, parts: Sequence[tuple[list[int], Any]]) -> Any:
    out = leaves(grads)
    for picks, sub in parts:
        for i, x in zip(picks, leaves(sub)):
            out[i] = x
    return map_leaves(grads, out)


def _check_mask(mask: Mask, node: Any, picks: list[int], what: str) -> None:
    pairs = leaves_with_paths(node)
    chosen = set(picks)
    check_selection(mask, pairs, [i in chosen for i in range(len(pairs))], what)


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` to the leaves ``mask`` selects; the others pass through unchanged.

    ``mask`` is a key pattern (a glob over ``"."``-joined key paths, where ``*`` matches any
    characters: ``"*.weight"``),
    a list of patterns, a callable ``(key_path, leaf) -> bool`` (decide by key, shape or
    dtype: it is called on the params at ``init`` and on the grads at ``update``), or a
    container of booleans with the params' keys. ``inner``'s state covers the selected leaves
    only (a TensorDict with their key paths). A pattern that matches no leaf, or a mask that
    selects none, raises ``KeyError`` naming the pattern and the nearest key.

    For AdamW's decoupled decay on some leaves only, use ``adamw(..., mask=...)``:
    ``masked(add_decayed_weights(...))`` is L2 regularisation (added before the Adam scaling),
    not AdamW's decay.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> p = tdfunc.TensorDict(w=torch.ones(2), bias=torch.ones(2))
        >>> opt = optim.masked(optim.add_decayed_weights(1.0), lambda path, x: path[-1] != "bias")
        >>> u, s = opt.update(p * 0, opt.init(p), p)
        >>> u["w"].tolist(), u["bias"].tolist()
        ([1.0, 1.0], [0.0, 0.0])
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(E.NOT_A_TRANSFORMATION.format(what="masked", typ=type(inner).__name__))
    sel = selector(mask, "masked")

    def label(path: KeyPath, x: Tensor) -> bool:
        return bool(sel(path, x))

    def init(params: Any) -> Any:
        check_container(params, "masked.init")
        ((picks, sub, _),) = _split(params, None, label, [True]).values()
        _check_mask(mask, params, picks, "masked.init")
        return make_state("masked", {"inner": inner.init(sub)}, params._batch_size)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        what = "masked.update"
        params = grads_and_params(grads, params, what, False)
        st = open_state(state, "masked", ["inner"], grads, what)
        ((picks, sub_g, sub_p),) = _split(grads, params, label, [True]).values()
        _check_mask(mask, grads, picks, what)
        sub_u, sub_state = inner.update(sub_g, st._tdf_get("inner", None), sub_p)
        return _merge(grads, [(picks, sub_u)]), new_state(state, "masked", {"inner": sub_state})

    return GradientTransformation(init, update)


def multi_transform(
    transforms: Mapping[str, GradientTransformation],
    labels: Callable[[KeyPath, Tensor], str] | Mapping[str, str],
) -> GradientTransformation:
    """A different transformation per group of leaves (e.g. per subtree).

    ``labels`` gives each leaf the name of its transformation: a callable
    ``(key_path, leaf) -> name``, or a mapping ``{key pattern: name}`` where the first pattern
    that matches the ``"."``-joined key path wins (``"*"`` as the last pattern catches the
    rest). A leaf whose name is not in ``transforms`` raises ``KeyError`` naming it; use
    :func:`set_to_zero` for frozen leaves. Each pattern must label at least one leaf: one
    that matches no leaf (a typo) or only leaves an earlier pattern took raises ``KeyError``
    naming it. The state holds one entry per name.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> p = tdfunc.TensorDict(body={"w": torch.ones(2)}, head={"w": torch.ones(2)})
        >>> opt = optim.multi_transform(
        ...     {"slow": optim.sgd(lr=0.1), "fast": optim.sgd(lr=1.0)},
        ...     {"body.*": "slow", "*": "fast"},
        ... )
        >>> u, s = opt.update(p, opt.init(p), p)
        >>> [round(x, 4) for x in (u["body", "w"][0].item(), u["head", "w"][0].item())]
        [-0.1, -1.0]
    """
    names = list(transforms)
    for n, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                E.NOT_A_TRANSFORMATION.format(what=f"multi_transform[{n!r}]", typ=type(t).__name__)
            )
    label_fn: Callable[[KeyPath, Tensor], Any]
    if isinstance(labels, Mapping):
        table = list(labels.items())

        def by_pattern(path: KeyPath, x: Tensor) -> Any:
            dotted = ".".join(path)
            for pattern, name in table:
                if glob_match(pattern, dotted):
                    return name
            return None

        label_fn = by_pattern
    elif callable(labels):
        label_fn = labels
    else:
        raise TypeError(E.BAD_LABELS.format(typ=type(labels).__name__))

    def checked(path: KeyPath, x: Tensor) -> Any:
        name = label_fn(path, x)
        if name not in transforms:
            raise KeyError(E.NO_LABEL.format(key=fmt_path(path), label=name, labels=names))
        return name

    def check_patterns(node: Any, what: str) -> None:
        # each pattern of a mapping labels at least one leaf: a typo or a pattern shadowed by
        # an earlier one would send its leaves to another transformation without a word
        if not isinstance(labels, Mapping):
            return
        pairs = leaves_with_paths(node)
        patterns = list(labels)
        winners = set()
        for path, _ in pairs:
            dotted = ".".join(path)
            for j, pattern in enumerate(patterns):
                if glob_match(pattern, dotted):
                    winners.add(j)
                    break
        for j, pattern in enumerate(patterns):
            if j in winners:
                continue
            check_selection(pattern, pairs, [True], what)  # raises when it matches no leaf
            earlier = next(
                p for p in patterns[:j] if any(glob_match(p, ".".join(k)) for k, _ in pairs)
            )
            raise KeyError(E.LABEL_SHADOWED.format(what=what, pattern=pattern, earlier=earlier))

    def init(params: Any) -> Any:
        check_container(params, "multi_transform.init")
        check_patterns(params, "multi_transform.init")
        parts = _split(params, None, checked, names)
        return make_state(
            "multi_transform",
            {n: transforms[n].init(parts[n][1]) for n in names},
            params._batch_size,
        )

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        what = "multi_transform.update"
        params = grads_and_params(grads, params, what, False)
        st = open_state(state, "multi_transform", names, grads, what)
        check_patterns(grads, what)
        parts = _split(grads, params, checked, names)
        new: dict[str, Any] = {}
        merged = []
        for n in names:
            picks, sub_g, sub_p = parts[n]
            sub_u, new[n] = transforms[n].update(sub_g, st._tdf_get(n, None), sub_p)
            merged.append((picks, sub_u))
        return _merge(grads, merged), new_state(state, "multi_transform", new)

    return GradientTransformation(init, update)
