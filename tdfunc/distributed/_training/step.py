"""A data-parallel training step over sharded parameters (FSDP's layout), as one pure function.

:func:`sharded_step` builds ``step(params, state, batch) -> (params, state, loss)``. The
parameters are a container of DTensors on a 1-D mesh, each ``Shard(0)`` (FSDP's layout;
uneven sizes allowed) or ``Replicate()`` (DDP's layout), or on a 2-D (replicate, shard) mesh
(HSDP), each ``(Replicate(), Shard(0))`` or ``(Replicate(), Replicate())``: gathered and
reduce-scattered along the shard dim, the gradients then averaged along the replicate dim
(one all-reduce per bucket); the optimizer state is what
``optimizer.init(params)`` returns; ``batch`` is this rank's part of the global batch. On
every rank of the mesh, one call:

1. gathers the full value of every sharded parameter: one all-gather of one flat buffer per
   dtype, in which each leaf's rows are padded to the same count on every rank (so uneven
   shards work) and cut back after; replicated leaves are used as they are;
2. computes ``loss_fn(full_params, batch)`` and its gradient with respect to the full
   parameters (``torch.func.grad_and_value``);
3. reduces the gradients: one reduce-scatter of a flat buffer per dtype for the sharded
   leaves (each rank keeps the rows it owns), one all-reduce per dtype for the replicated
   ones, both divided by the number of ranks: the
   gradient of the mean of the ranks' losses, which is the gradient of the mean loss over the
   global batch when every rank's part has the same size;
4. updates the parameters with ``optimizer.update`` and :func:`tdfunc.optim.apply_updates` on
   DTensors built from the local gradient shards (no communication), so transforms that
   reduce over all leaves (a global-norm clip) reduce across ranks;
5. returns the new parameters (same placements), the new state and the loss averaged over
   the ranks (an all-reduce of one number). The inputs are not changed.

What is gathered when. By default, the whole parameter set, before the forward. Each
collective moves one flat buffer of at most ``bucket_mb`` MiB of full values (leaves of one
dtype packed together). The full parameters and gradients live only for the forward and
backward: each bucket of full gradients is let go once it is packed for its reduce-scatter,
and the optimizer runs on shards only. Peak memory per rank is then the full parameters and
gradients at the end of the backward, plus ``1/n`` of the parameters and optimizer state.

With ``units=[key prefixes]`` (eager), FSDP's schedule instead (:mod:`.units`): each unit
(the parameters under one prefix, e.g. one transformer block) is gathered when the forward
first uses it and let go when the forward moves on to the next unit; autograd keeps a recipe
instead of the full values it saves (a saved-tensor hook), and the backward gathers the unit
again when it reaches it; each unit's gradients are reduce-scattered as soon as the backward
is done with the unit. The parameters under no prefix are gathered once and kept for the
step, as FSDP2 keeps its root module's. Peak memory per rank is then about one unit of full
parameters and gradients above the shards, optimizer state and activations; each unit is
gathered twice per step, as FSDP2 does. This path differentiates with plain autograd
(``torch.autograd.grad``: functorch refuses saved-tensor hooks); ``loss_fn`` sees
:class:`~tdfunc.distributed._training.units.Placeholder` tensors for the sharded parameters,
which gather on first use and refuse in-place writes.

With ``units`` and ``compile=True``: the loss as a function of the local shards is compiled
(:func:`_loss_of_shards`: each unit gathered by differentiable all-gathers, one per bucket,
whose backward reduce-scatters), and ``torch.autograd.grad`` runs its compiled backward.
AOTAutograd partitions forward and backward; under the memory budget set for it
(``recompute_collectives`` in ``_compat``: it may recompute collectives) it gathers the
units again in the backward rather than keeping their full values, and inductor frees each
full value after its last use. The update runs eagerly around it (the fused kernel). So
this mode is two graphs per step (forward, backward) and an eager update, as FSDP2's
compiled mode is, where ``compile=True`` alone is one graph for the whole step.

The update is :func:`tdfunc.optim.step`: eagerly, torch's fused kernel (``_fused_adamw_``...)
on the local shards where one fits, on copies (pure) or, with ``donate=True``, in place.

With ``compile=True`` the step is one ``torch.compile(fullgraph=True)`` graph per rank,
collectives included (torch's functional collectives, which Dynamo traces); the structure
check below runs eagerly before it, once per new structure. With ``donate=True`` the new
parameters and state are written into the local shards passed in (the donation rules of
:func:`tdfunc.compile`: checked eagerly before the call, the containers consumed after it).

Before the first call with a new structure every rank compares a digest of what it passes
(parameter keys, global shapes, dtypes and placements, state keys and shapes, the keys,
shapes and dtypes of its batch): ranks that differ all raise the same ``ValueError`` before
any data moves, and a rank that rejects its own arguments tells the others, which raise too.
A rank that dies makes the others fail in their next collective, within the process group's
timeout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ... import optim
from ..._compat import functional_collectives, pytree, recompute_collectives
from ..._donate import check_donated, check_not_consumed, consume, store_outputs
from ..._keys import KeyPath, fmt_key
from ..._tree import is_node, leaves, leaves_with_paths, map_leaves
from ...optim._step import fused_of
from .._common import agree
from .._common import errors as E
from .._common.mesh import describe_mesh
from .units import REST, Placeholder, UnitGather, unit_keys, unit_of_leaves

P = TypeVar("P")
S = TypeVar("S")

OP = "sharded_step"
#: the placements of the gradients made from local shards (one object each: Dynamo guards on
#: the identity of placements it reads, and these never change)
_SHARDED = (Shard(0),)
_REPLICATED = (Replicate(),)
#: the same on a 2-D (replicate, shard) mesh (HSDP)
_HSDP_SHARDED = (Replicate(), Shard(0))
_HSDP_REPLICATED = (Replicate(), Replicate())


class _Layout:
    """What the traced step needs to know about the parameters: their mesh, and per leaf
    whether it is sharded (with its global row count) or replicated. On a 2-D mesh (HSDP:
    dims (replicate, shard)) ``group`` / ``n`` are the shard dim's, ``replicas`` /
    ``n_replicas`` the replicate dim's (None / 1 on a 1-D mesh)."""

    __slots__ = (
        "cap",
        "dtypes",
        "fc",
        "gathers",
        "group",
        "mesh",
        "n",
        "n_replicas",
        "nbytes",
        "placements",
        "replicas",
        "replicated_groups",
        "rows",
        "sharded",
        "sharded_groups",
    )

    def __init__(
        self,
        mesh: DeviceMesh,
        sharded: list[bool],
        rows: list[int],
        dtypes: list[torch.dtype],
        nbytes: list[int],
        cap: int,
    ) -> None:
        self.mesh = mesh
        last = mesh.ndim - 1
        self.n = mesh.size(last)
        self.group = mesh.get_group(last)
        self.replicas = mesh.get_group(0) if last else None
        self.n_replicas = mesh.size(0) if last else 1
        #: the placements of a sharded / replicated gradient
        self.placements = (_HSDP_SHARDED, _HSDP_REPLICATED) if last else (_SHARDED, _REPLICATED)
        self.sharded = tuple(sharded)
        self.rows = tuple(rows)
        self.dtypes, self.nbytes, self.cap = tuple(dtypes), tuple(nbytes), cap
        #: with units: how many times units were gathered (forward, backward) in the call
        self.gathers: tuple[int, int] | None = None
        #: positions of the sharded / replicated leaves in groups of one dtype and at most
        #: ``cap`` bytes of full values (or one larger leaf): each group's collective moves
        #: one flat buffer
        self.sharded_groups = _groups(sharded, dtypes, True, nbytes, cap)
        self.replicated_groups = _groups(sharded, dtypes, False, nbytes, cap)
        #: torch's functional collectives (looked up here: an import is not traceable)
        self.fc = functional_collectives()


def _layout(params: Any, cap: int) -> tuple[_Layout, list[tuple[KeyPath, Tensor]]]:
    """Check the parameters (typed errors naming the key) and read their layout (``cap``:
    the most bytes of full values one collective moves)."""
    if not is_node(params):
        raise TypeError(E.NOT_A_CONTAINER.format(op=OP, typ=type(params).__name__))
    pairs = leaves_with_paths(params)
    if not pairs:
        raise ValueError(E.STEP_NO_PARAMS.format(op=OP))
    mesh: DeviceMesh | None = None
    sharded: list[bool] = []
    rows: list[int] = []
    for path, p in pairs:
        if not isinstance(p, DTensor):
            raise TypeError(E.NOT_DTENSOR.format(key=fmt_key(path), op=OP, typ=type(p).__name__))
        if mesh is None:
            mesh = p.device_mesh
            if mesh.ndim not in (1, 2):
                raise ValueError(
                    E.STEP_MESH_NDIM.format(op=OP, key=fmt_key(path), mesh=describe_mesh(mesh))
                )
        elif p.device_mesh != mesh:
            raise ValueError(
                E.STEP_MIXED_MESH.format(
                    op=OP,
                    key=fmt_key(path),
                    mesh=describe_mesh(p.device_mesh),
                    first=describe_mesh(mesh),
                )
            )
        *outer, pl = p.placements  # on a 2-D mesh: (replicate dim, shard dim)
        if any(not isinstance(o, Replicate) for o in outer):
            raise ValueError(
                E.STEP_PLACEMENT.format(op=OP, key=fmt_key(path), placement=p.placements)
            )
        if isinstance(pl, Shard) and pl.dim == 0:
            sharded.append(True)
            rows.append(int(p.shape[0]))
        elif isinstance(pl, Replicate):
            sharded.append(False)
            rows.append(0)
        else:
            raise ValueError(
                E.STEP_PLACEMENT.format(op=OP, key=fmt_key(path), placement=p.placements)
            )
    assert mesh is not None
    dtypes = [p.dtype for _, p in pairs]
    nbytes = [p.numel() * p.element_size() for _, p in pairs]
    return _Layout(mesh, sharded, rows, dtypes, nbytes, cap), pairs


def _groups(
    flags: list[bool], dtypes: list[torch.dtype], want: bool, nbytes: list[int], cap: int
) -> tuple[tuple[int, ...], ...]:
    """Positions of the leaves with ``flags[i] == want`` in groups of one dtype, in order, each
    of at most ``cap`` bytes (``nbytes``) unless one leaf alone is larger.

    Example:
        >>> _groups([True] * 3, [torch.float32] * 3, True, [4, 4, 4], 8)
        ((0, 1), (2,))
    """
    done: list[tuple[int, ...]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, (f, d, b) in enumerate(zip(flags, dtypes, nbytes)):
        if f != want:
            continue
        ix, size = open_.get(d, ([], 0))
        if ix and size + b > cap:
            done.append(tuple(ix))
            ix, size = [], 0
        ix.append(i)
        open_[d] = (ix, size + b)
    done.extend(tuple(ix) for ix, _ in open_.values())
    return tuple(done)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    """``t`` with zero rows appended up to ``rows`` rows."""
    if t.shape[0] == rows:
        return t
    return torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1) + [0, rows - t.shape[0]])


def _gather(
    fc: Any, local: list[Tensor], rows: list[int], n: int, group: Any, autograd: bool = False
) -> list[Tensor]:
    """The full values of ``Shard(0)`` leaves of one dtype from this rank's rows: one
    all-gather of a flat buffer (each leaf padded to the same row count on every rank)."""
    pers = [-(-r // n) for r in rows]
    flat = torch.cat([_pad_rows(t, per).reshape(-1) for t, per in zip(local, pers)])
    # waited at once: views of the collective's pending result would each pass through its
    # Python wrapper eagerly (traced, the wait is where the graph needs the values anyway)
    if autograd:  # differentiable: its backward is a reduce-scatter (sum) of the gradients
        every = fc.wait_tensor(fc.all_gather_single_autograd(flat, 0, group)).view(n, -1)
    else:
        every = fc.wait_tensor(fc.all_gather_single(flat, 0, group)).view(n, -1)  # rank-major
    out, off = [], 0
    for t, per, r in zip(local, pers, rows):
        size = per * math.prod(t.shape[1:])
        block = every[:, off : off + size].reshape(n * per, *t.shape[1:])
        out.append(block if n * per == r else block[:r])
        off += size
    return out


def _scatter(
    fc: Any, grads: list[Tensor], local_rows: list[int], n: int, group: Any
) -> list[Tensor]:
    """This rank's rows of the mean over the ranks of full gradients of one dtype: one
    reduce-scatter of a flat buffer laid out rank by rank. Empties ``grads`` once they are
    copied into that buffer (so that nothing here keeps the full gradients alive)."""
    pers = [-(-g.shape[0] // n) for g in grads]
    inner = [g.shape[1:] for g in grads]
    flat = torch.cat(
        [_pad_rows(g, per * n).reshape(n, -1) for g, per in zip(grads, pers)], dim=1
    ).reshape(-1)
    grads.clear()  # the caller's list: the full gradients can go once they are in one buffer
    mine = fc.reduce_scatter_single(flat, "sum", 0, group) / n
    del flat
    out, off = [], 0
    for shape, per, lr in zip(inner, pers, local_rows):
        size = per * math.prod(shape)
        block = mine[off : off + size].view(per, *shape)
        out.append(block if lr == per else block[:lr])
        off += size
    return out


def _average(fc: Any, ts: list[Tensor], n: int, group: Any) -> list[Tensor]:
    """The means over the ranks of tensors of one dtype: one all-reduce of a flat buffer."""
    flat = fc.all_reduce(torch.cat([t.reshape(-1) for t in ts]), "sum", group) / n
    out, off = [], 0
    for t in ts:
        out.append(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()
    return out


def _across_replicas(layout: _Layout, reduced: list[Any]) -> list[Any]:
    """On a 2-D mesh, the means over the replicate dim of the gradients already reduced over
    the shard dim (one all-reduce per bucket); unchanged on a 1-D mesh."""
    if layout.replicas is None:
        return reduced
    for ix in (*layout.sharded_groups, *layout.replicated_groups):
        got = _average(layout.fc, [reduced[i] for i in ix], layout.n_replicas, layout.replicas)
        for i, g in zip(ix, got):
            reduced[i] = g
    return reduced


def _autograd(loss: Tensor, leaves_: list[Tensor]) -> tuple[Tensor, ...]:
    """The gradients of ``loss`` with respect to ``leaves_`` (zeros where it does not depend
    on them, or on none of them)."""
    if loss.requires_grad:
        return torch.autograd.grad(loss, leaves_, allow_unused=True, materialize_grads=True)
    return tuple(torch.zeros_like(t) for t in leaves_)


def _finish(layout: _Layout, reduced: list[Any]) -> list[Any]:
    """The last reductions, once the sharded leaves' gradients are reduce-scattered: the
    replicated leaves' averaged over the shard dim, then all over the replicate dim."""
    fc, n, group = layout.fc, layout.n, layout.group
    for ix in layout.replicated_groups:
        for i, g in zip(ix, _average(fc, [reduced[i] for i in ix], n, group)):
            reduced[i] = g
    return _across_replicas(layout, reduced)


def _local_grads(
    loss_fn: Callable[[Any, Any], Tensor],
    layout: _Layout,
    params: Any,
    local: list[Tensor],
    batch: Any,
) -> tuple[list[Tensor], Tensor]:
    """Gather, differentiate, reduce: this rank's part of the mean gradient of each leaf
    (``local``: the local shards, in leaf order) and the loss. The full parameters and
    gradients live only in here: the optimizer that runs next never holds them."""
    n, group, fc = layout.n, layout.group, layout.fc
    full = list(local)
    for ix in layout.sharded_groups:
        got = _gather(fc, [local[i] for i in ix], [layout.rows[i] for i in ix], n, group)
        for i, t in zip(ix, got):
            full[i] = t
    grads_full, loss = torch.func.grad_and_value(loss_fn)(map_leaves(params, full), batch)
    del full  # the gathered parameters: only their gradients are needed from here
    reduced: list[Any] = [g for _, g in leaves_with_paths(grads_full)]
    del grads_full
    for ix in layout.sharded_groups:
        part = [reduced[i] for i in ix]
        for i in ix:
            reduced[i] = None  # _scatter lets go of the full gradients as it packs them
        rows = [local[i].shape[0] for i in ix]
        for i, g in zip(ix, _scatter(fc, part, rows, n, group)):
            reduced[i] = g
    return _finish(layout, reduced), loss


def _local_grads_by_unit(
    loss_fn: Callable[[Any, Any], Tensor],
    layout: _Layout,
    params: Any,
    local: list[Tensor],
    batch: Any,
    unit_of: tuple[int, ...],
) -> tuple[list[Tensor], Tensor]:
    """:func:`_local_grads` gathering one unit at a time (``unit_of``: each leaf's unit, -1
    for replicated leaves), eagerly, on plain autograd (see :mod:`.units`)."""
    n, group, fc = layout.n, layout.group, layout.fc
    leaves_ = [t.detach().requires_grad_() for t in local]
    paths = [p for p, _ in leaves_with_paths(params)]

    def buckets(ix: list[int]) -> list[list[int]]:
        # the leaves of one unit in buckets of one dtype and at most ``cap`` bytes
        dtypes, nbytes = [layout.dtypes[i] for i in ix], [layout.nbytes[i] for i in ix]
        return [
            [ix[k] for k in g] for g in _groups([True] * len(ix), dtypes, True, nbytes, layout.cap)
        ]

    def gather(ix: list[int]) -> list[Tensor]:
        got: dict[int, Tensor] = {}
        for pos in buckets(ix):
            rows = [layout.rows[i] for i in pos]
            # plain tensors (waited): the saved-tensor hook recognises their memory
            got.update(zip(pos, _gather(fc, [local[i] for i in pos], rows, n, group)))
        return [got[i] for i in ix]

    def scatter(ix: list[int], grads: list[Tensor]) -> list[Tensor]:
        got: dict[int, Tensor] = {}
        by_leaf = dict(zip(ix, grads))
        grads.clear()  # the full gradients go as each bucket is packed
        for pos in buckets(ix):
            part = [by_leaf.pop(i) for i in pos]
            rows = [local[i].shape[0] for i in pos]
            got.update(zip(pos, _scatter(fc, part, rows, n, group)))
        return [got[i] for i in ix]

    gatherer = UnitGather(gather, scatter, unit_of, leaves_, unit_keys(paths), REST)
    given = [
        Placeholder.make(torch.Size((layout.rows[i], *t.shape[1:])), t.dtype, t.device, gatherer, i)
        if u >= 0
        else leaves_[i]
        for i, (t, u) in enumerate(zip(local, unit_of))
    ]
    with (
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(gatherer.pack, gatherer.unpack),
    ):
        loss = loss_fn(map_leaves(params, given), batch)
    gatherer.end_forward()
    del given
    reduced: list[Any] = list(_autograd(loss, leaves_))
    gatherer.release_backward(gatherer.back_unit)
    layout.gathers = (gatherer.gathers[0], gatherer.gathers[1])
    return _finish(layout, reduced), loss.detach()


def _loss_of_shards(
    loss_fn: Callable[[Any, Any], Tensor],
    layout: _Layout,
    unit_of: tuple[int, ...],
    local: Any,
    batch: Any,
) -> Tensor:
    """The loss as a function of the local shards (``local``: the parameters' structure with
    the local shards, requiring grad): each unit gathered by differentiable all-gathers (one
    per bucket of the unit), whose backward reduce-scatters. What ``compile=True`` with
    ``units`` compiles: AOTAutograd partitions it into a forward and a backward graph, and
    may gather a unit again in the backward instead of keeping its full values."""
    n, group, fc = layout.n, layout.group, layout.fc
    shards = leaves(local)
    full = list(shards)
    for u in sorted(set(unit_of) - {-1}):
        ix = [i for i, v in enumerate(unit_of) if v == u]
        dtypes, nbytes = [layout.dtypes[i] for i in ix], [layout.nbytes[i] for i in ix]
        for g in _groups([True] * len(ix), dtypes, True, nbytes, layout.cap):
            pos = [ix[k] for k in g]
            rows = [layout.rows[i] for i in pos]
            got = _gather(fc, [shards[i] for i in pos], rows, n, group, autograd=True)
            for i, t in zip(pos, got):
                full[i] = t
    return loss_fn(map_leaves(local, full), batch)


def _local_grads_compiled_units(
    loss_fn: Callable[[Any, Any], Tensor],
    layout: _Layout,
    params: Any,
    local: list[Tensor],
    batch: Any,
    unit_of: tuple[int, ...],
    compiled_loss: Callable[..., Tensor],
) -> tuple[list[Tensor], Tensor]:
    """:func:`_local_grads` through ``compiled_loss`` (:func:`_loss_of_shards` compiled) and
    ``torch.autograd.grad``: the sharded leaves' gradients come reduce-scattered (sums) from
    the compiled backward."""
    leaves_ = [t.detach().requires_grad_() for t in local]
    with torch.enable_grad(), recompute_collectives():
        loss = compiled_loss(loss_fn, layout, unit_of, map_leaves(params, leaves_), batch)
    got = _autograd(loss, leaves_)  # the sharded leaves': sums over the shard dim
    reduced: list[Any] = [g / layout.n if u >= 0 else g for g, u in zip(got, unit_of)]
    del got
    return _finish(layout, reduced), loss.detach()


def _grads(
    loss_fn: Callable[[Any, Any], Tensor],
    layout: _Layout,
    params: Any,
    batch: Any,
    unit_of: tuple[int, ...] | None,
    compiled_loss: Callable[..., Tensor] | None = None,
) -> tuple[Any, Tensor]:
    """The mean gradient over the ranks (DTensors built from this rank's parts, in the
    parameters' structure: no communication) and the loss averaged over the ranks."""
    dparams: list[DTensor] = [p for _, p in leaves_with_paths(params)]  # type: ignore[misc]
    local = [p.to_local() for p in dparams]
    if unit_of is None:
        reduced, loss = _local_grads(loss_fn, layout, params, local, batch)
    elif compiled_loss is not None:
        reduced, loss = _local_grads_compiled_units(
            loss_fn, layout, params, local, batch, unit_of, compiled_loss
        )
    else:
        reduced, loss = _local_grads_by_unit(loss_fn, layout, params, local, batch, unit_of)
    del local
    grads = [
        DTensor.from_local(
            g,
            layout.mesh,
            layout.placements[0] if s else layout.placements[1],
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
        for g, p, s in zip(reduced, dparams, layout.sharded)
    ]
    (mean_loss,) = _average(layout.fc, [loss.detach()], layout.n, layout.group)
    if layout.replicas is not None:
        (mean_loss,) = _average(layout.fc, [mean_loss], layout.n_replicas, layout.replicas)
    return map_leaves(params, grads), mean_loss


def _core(
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: optim.GradientTransformation,
    layout: _Layout,
    params: Any,
    state: Any,
    batch: Any,
    unit_of: tuple[int, ...] | None = None,
    compiled_loss: Callable[..., Tensor] | None = None,
) -> tuple[Any, Any, Tensor]:
    """The step itself (what ``torch.compile`` traces): gather, grad, reduce, update.

    Everything runs under ``no_grad`` (``torch.func.grad`` differentiates inside it anyway): a
    step records nothing for autograd, and its outputs never require grad, so the next call
    matches the same graph. The update is :func:`tdfunc.optim.step`: eagerly, torch's fused
    kernel on copies of the local shards where one fits; traced, ``update`` +
    ``apply_updates``.
    """
    with torch.no_grad():
        grads, mean_loss = _grads(loss_fn, layout, params, batch, unit_of, compiled_loss)
        new_params, new_state = optim.step(optimizer, grads, state, params)
        return new_params, new_state, mean_loss


def _core_donated(
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: optim.GradientTransformation,
    layout: _Layout,
    params: Any,
    state: Any,
    batch: Any,
    unit_of: tuple[int, ...] | None = None,
    compiled_loss: Callable[..., Tensor] | None = None,
) -> tuple[Any, Any, Tensor]:
    """:func:`_core` with the new parameters and state written into the given ones (donated;
    compiled: inductor stores the results straight into the local shards)."""
    new_params, new_state, loss = _core(
        loss_fn, optimizer, layout, params, state, batch, unit_of, compiled_loss
    )
    with torch.no_grad():
        new_params, new_state = store_outputs(
            (new_params, new_state), [*leaves(params), *leaves(state)]
        )
    return new_params, new_state, loss


def _core_in_place(
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: optim.GradientTransformation,
    layout: _Layout,
    params: Any,
    state: Any,
    batch: Any,
    unit_of: tuple[int, ...] | None = None,
    compiled_loss: Callable[..., Tensor] | None = None,
) -> tuple[Any, Any, Tensor]:
    """The eager donated step: torch's fused kernel writes the new values into the given
    local shards and state (no new buffers), where one fits; otherwise :func:`_core_donated`'s
    update and copy."""
    with torch.no_grad():
        grads, mean_loss = _grads(loss_fn, layout, params, batch, unit_of, compiled_loss)
        fused = fused_of(optimizer)
        out = fused(grads, state, params, True) if fused is not None else None
        if out is None:
            updates, new_state = optimizer.update(grads, state, params)
            out = store_outputs(
                (optim.apply_updates(params, updates), new_state),
                [*leaves(params), *leaves(state)],
            )
        return out[0], out[1], mean_loss


Signature = tuple[
    tuple[KeyPath, ...], tuple[tuple[int, ...], ...], tuple[torch.dtype, ...], tuple[Any, ...]
]


def _signature(
    pairs: list[tuple[KeyPath, Tensor]],
    state: Any,
    batch: Any,
    units: tuple[str, ...] | None = None,
) -> Signature:
    """What the ranks compare: key paths, shapes, dtypes and placements of the parameters
    (global), the state and the batch (this rank's part), the batch's structure and the
    units gathered one by one (a different schedule would pair different collectives)."""
    paths: list[KeyPath] = []
    shapes: list[tuple[int, ...]] = []
    dtypes: list[torch.dtype] = []
    placements: list[tuple[str, ...]] = []
    for path, p in pairs:
        paths.append(("params", *path))
        shapes.append(tuple(p.shape))
        dtypes.append(p.dtype)
        placements.append(tuple(repr(x) for x in p.placements))  # type: ignore[attr-defined]
    for name, tree in (("state", state), ("batch", batch)):
        flat, spec = pytree.tree_flatten_with_path(tree)
        for kp, x in flat:
            paths.append((name, pytree.keystr(kp)))
            if isinstance(x, Tensor):
                shapes.append(tuple(x.shape))
                dtypes.append(x.dtype)
                placements.append(
                    tuple(repr(q) for q in x.placements) if isinstance(x, DTensor) else ()
                )
            else:
                shapes.append(())
                dtypes.append(torch.float32)
                placements.append((repr(x),))
        placements.append((name, str(spec)))
        paths.append((name, "<structure>"))
        shapes.append(())
        dtypes.append(torch.float32)
    paths.append(("units", "<units>"))
    shapes.append(())
    dtypes.append(torch.float32)
    placements.append(("units", repr(units)))
    return tuple(paths), tuple(shapes), tuple(dtypes), tuple(placements)


class ShardedStep(Generic[P, S]):
    """The step built by :func:`sharded_step`: ``step(params, state, batch)`` returns
    ``(params, state, loss)``; see there.

    Attributes:
        loss_fn: the loss function it differentiates.
        optimizer: the gradient transformation it applies.
        compiled: whether the step runs as one compiled graph.
        donate: whether the parameters and state passed in are donated.
        bucket_bytes: the most bytes of full values one collective moves.
        units: the key prefixes gathered one at a time (None: the whole model at once).
        gathers: with ``units``, how many times the last call gathered a unit in the forward
            and in the backward (each gather: one all-gather per bucket of the unit).
        calls: the number of calls so far.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: optim.GradientTransformation,
        *,
        compile: bool = False,
        donate: bool = False,
        bucket_mb: float = 4.0,
        units: Sequence[str] | None = None,
        **compile_kwargs: Any,
    ) -> None:
        if units is not None:
            if not isinstance(units, (list, tuple)) or not all(
                isinstance(u, str) and u for u in units
            ):
                raise TypeError(E.STEP_UNITS_TYPE.format(op=OP, value=units))
            for j, u in enumerate(units):
                if u in units[:j]:
                    raise ValueError(E.STEP_UNITS_DUPLICATE.format(op=OP, unit=u))
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
            raise TypeError(E.STEP_BUCKET.format(op=OP, value=bucket_mb))
        if not 0 < bucket_mb < math.inf:
            raise ValueError(E.STEP_BUCKET.format(op=OP, value=bucket_mb))
        if not callable(loss_fn):
            raise TypeError(E.STEP_NOT_CALLABLE.format(op=OP, typ=type(loss_fn).__name__))
        if not isinstance(optimizer, optim.GradientTransformation):
            raise TypeError(E.STEP_OPTIMIZER.format(op=OP, typ=type(optimizer).__name__))
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.compiled = bool(compile)
        self.donate = bool(donate)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.units: tuple[str, ...] | None = None if units is None else tuple(units)
        self.gathers: tuple[int, int] | None = None
        self.calls = 0
        #: with units and compile=True: the compiled loss of the shards (forward and
        #: backward graphs); the step around it runs eagerly
        self._compiled_loss: Callable[..., Tensor] | None = None
        if compile and units is not None:
            self._compiled_loss = torch.compile(_loss_of_shards, fullgraph=True, **compile_kwargs)
            compile = False
        core = (_core_donated if compile else _core_in_place) if donate else _core
        self._core: Callable[..., tuple[Any, Any, Tensor]] = core
        if compile:
            self._core = torch.compile(core, fullgraph=True, **compile_kwargs)
        self._agreed: set[Any] = set()

    def __call__(self, params: P, state: S, batch: Any) -> tuple[P, S, Tensor]:
        if self.donate:  # a consumed container says so before anything reads it
            check_not_consumed(params)
            check_not_consumed(state)
        try:
            layout, pairs = _layout(params, self.bucket_bytes)
        except (TypeError, ValueError):
            mesh = _some_mesh(params, state)
            if mesh is not None:
                agree.reject(OP, mesh)
            raise
        unit_of: tuple[int, ...] | None = None
        if self.units is not None:
            try:
                unit_of = unit_of_leaves([p for p, _ in pairs], layout.sharded, self.units)
            except KeyError:
                agree.reject(OP, layout.mesh)
                raise
        given = (params, state)
        if self.donate:
            try:
                check_donated(given, {}, (0, 1), OP, grad_ok=True, names=("params", "state"))
            except ValueError:  # leaves that share memory: tell the other ranks
                agree.reject(OP, layout.mesh)
                raise
        if any(p.requires_grad for _, p in pairs):
            # parameters distributed from nn.Parameters: the step records nothing for autograd,
            # and its outputs do not require grad; detached here, the first call and the next
            # ones (with the outputs) match the same compiled graph
            params = map_leaves(params, [p.detach() for _, p in pairs])  # type: ignore[arg-type]
        sig = _signature(pairs, state, batch, self.units)
        if sig not in self._agreed:
            paths, shapes, dtypes, placements = sig
            agree.check(OP, OP, layout.mesh, paths, shapes, dtypes, placements, ())
            self._agreed.add(sig)
        out = self._core(
            self.loss_fn, self.optimizer, layout, params, state, batch, unit_of, self._compiled_loss
        )
        self.gathers = layout.gathers
        self.calls += 1
        if self.donate:
            for i, x in enumerate(given):
                consume(x, E.STEP_DONATED.format(what=("params", "state")[i], call=self.calls))
        return out


def _some_mesh(*trees: Any) -> DeviceMesh | None:
    """The mesh of the first DTensor leaf of ``trees`` (the parameters, then the optimizer
    state), to tell its ranks about a rejection; ``None`` if there is none (the other ranks
    then fail in their next collective, within the process group's timeout)."""
    for tree in trees:
        for x in pytree.tree_leaves(tree):
            if isinstance(x, DTensor):
                return x.device_mesh
    return None


def sharded_step(
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: optim.GradientTransformation,
    *,
    compile: bool = False,
    donate: bool = False,
    bucket_mb: float = 4.0,
    units: Sequence[str] | None = None,
    **compile_kwargs: Any,
) -> ShardedStep[Any, Any]:
    """A data-parallel training step over parameters sharded across the ranks of a mesh.

    ``step = sharded_step(loss_fn, optimizer)``; then, on every rank of the mesh,
    ``params, state, loss = step(params, state, batch)``. ``params`` is a container of DTensors
    on one 1-D mesh, each ``Shard(0)`` (FSDP's layout: each rank holds a block of rows, uneven
    sizes allowed) or ``Replicate()`` (DDP's layout), or on one 2-D (replicate, shard) mesh
    with ``(Replicate(), Shard(0))`` or ``(Replicate(), Replicate())`` (HSDP), e.g. from
    ``tdfunc.distributed.distribute(tdfunc.from_module(model), mesh, [Shard(0)])``; ``state`` is
    ``optimizer.init(params)``; ``batch`` (any pytree) is this rank's part of the global batch.

    The step gathers the full parameters, computes ``loss_fn(full_params, batch)`` and its
    gradient, averages the gradients over the ranks while scattering them back to the shards
    (reduce-scatter; all-reduce for replicated leaves), and applies the optimizer to the
    shards; ``loss`` is the loss averaged over the ranks. With equal batch parts on every rank
    it computes what one process computes on the whole batch. The inputs are not changed.
    With ``units``, it gathers one unit (e.g. one transformer block) at a time instead, as
    FSDP does, for a peak memory near one unit of full values (module docstring).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar tensor``; ``params`` is a container of the
            same type with the full (gathered) parameters as plain tensors, e.g. passed to
            :func:`tdfunc.functional_call`.
        optimizer: a :class:`tdfunc.optim.GradientTransformation`; its update sees DTensor
            gradients, parameters and state, so a global-norm clip reduces across ranks.
        compile: run the step as one ``torch.compile(fullgraph=True)`` graph per rank,
            collectives included (no graph break; a new graph only for a new structure).
        donate: the caller will not use the parameters and state it passes again: the new
            ones are written into their local shards (eager, torch's fused kernel updates
            them in place where one fits; compiled, inductor stores the results there: no
            new buffers per step) and the containers passed in are consumed (a
            later use raises :class:`tdfunc.DonatedError`), as with
            :func:`tdfunc.compile`'s ``donate``; the values are those of the undonated step.
        units: key prefixes of the parameters (dotted, e.g. ``["transformer.h.0",
            "transformer.h.1"]``) gathered one unit at a time (FSDP's schedule: see the
            module); with ``compile=True``, the loss compiled with the gathers recomputed
            in the backward (two graphs and an eager update). ``None`` (default): the whole
            model at once. Every rank
            must pass the same units, and the forward must use them in the same order on
            every rank (each gather is a collective).
        bucket_mb: the most MiB of full values one collective moves: the leaves of one
            dtype are packed into flat buffers of up to this size (a larger leaf alone), one
            all-gather and one reduce-scatter (or all-reduce) each. Smaller buckets lower the
            memory a collective holds for a moment (gloo's reduce-scatter copies its whole
            input once more); larger ones need fewer collectives. The values computed do not
            depend on it.
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``...).

    Returns:
        A :class:`ShardedStep`.

    Raises:
        TypeError: ``loss_fn`` is not callable, ``optimizer`` is not a gradient
            transformation, ``bucket_mb`` is not a number or ``units`` is not a list or
            tuple of non-empty strings (here); at a call, a parameter that is not a DTensor,
            ``params`` that is not a container, or (with ``units``) a forward that writes a
            parameter in place.
        KeyError: with ``units``, a prefix that no sharded parameter's key starts with (at
            a call; the other ranks raise ``ValueError`` naming this rank).
        ValueError: ``bucket_mb`` is not positive and finite, or a unit is given twice
            (here); at a call, parameters
            on a mesh that is neither 1-D nor 2-D or on different meshes,
            a placement other than ``Shard(0)`` / ``Replicate()`` (each naming the key), or
            ranks that pass different structures or units (raised on every rank before data
            moves);
            with ``donate=True``, donated leaves that share memory.
        tdfunc.DonatedError: with ``donate=True``, parameters or state that an earlier call
            consumed.

    Example:
        >>> import torch, torch.distributed as dist, tdfunc
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard
        >>> from tdfunc import optim
        >>> from tdfunc.distributed import distribute, sharded_step
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> model = torch.nn.Linear(3, 1)
        >>> params = distribute(tdfunc.from_module(model), mesh, [Shard(0)])
        >>> def loss_fn(p, batch):
        ...     x, y = batch
        ...     return ((tdfunc.functional_call(model, p, (x,)) - y) ** 2).mean()
        >>> opt = optim.sgd(0.1)
        >>> step = sharded_step(loss_fn, opt)
        >>> params, state, loss = step(params, opt.init(params), (torch.ones(4, 3), torch.zeros(4, 1)))
        >>> loss.shape, type(params["weight"]).__name__
        (torch.Size([]), 'DTensor')
        >>> # FSDP's schedule: each unit gathered on use (here one: the whole Linear)
        >>> by_unit = sharded_step(loss_fn, opt, units=["weight"], donate=True)
        >>> params, state, loss = by_unit(params, opt.init(params), (torch.ones(4, 3), torch.zeros(4, 1)))
        >>> by_unit.gathers  # forward: the unit, the rest; the backward reads no weight here
        (2, 0)
    """
    return ShardedStep(
        loss_fn,
        optimizer,
        compile=compile,
        donate=donate,
        bucket_mb=bucket_mb,
        units=units,
        **compile_kwargs,
    )
