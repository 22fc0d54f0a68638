"""``torch.export`` support: the ``dynamic_shapes`` spec that marks batch dims dynamic.

``torch.export.export`` pairs ``dynamic_shapes`` with the flattened inputs: for a pytree node
such as a TensorDict it expects a *list* with one entry per child, in flatten order. To torch's
pytree a container and every container nested in it are one node whose children are all its
tensor leaves (depth first, in key order), so the list is flat: one entry per leaf.
:func:`dynamic_batch_shapes` writes that list from an example input, so no one has to spell
out the flatten order by hand.

Saving and loading exported programs needs nothing more: TensorDict and tensorclasses are
registered with a ``serialized_type_name`` (their pytree specs are written as JSON) and are
allow-listed for ``torch.load(weights_only=True)`` when their module is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.export import Dim

from . import _errors as E
from ._tree import is_node


def _leaf_spec(dims: Mapping[int, Any]) -> dict[int, Any] | None:
    return dict(dims) if dims else None


def _node_spec(node: Any, dims: Mapping[int, Any], out: list[Any] | None = None) -> list[Any]:
    out = [] if out is None else out
    for v in node._tdf_children():
        if v is None:
            continue  # a None field is structure, not a child
        if isinstance(v, Tensor):
            out.append(_leaf_spec(dims))
        else:
            _node_spec(v, dims, out)  # nested containers: their leaves, in place
    return out


def _spec(x: Any, dims: Mapping[int, Any], path: str) -> Any:
    if is_node(x):
        for d in dims:
            if not 0 <= d < len(x._batch_size):
                raise ValueError(
                    E.NOT_A_BATCH_DIM.format(
                        dim=d,
                        cls=type(x).__name__,
                        path=path or "the root",
                        batch_size=tuple(x._batch_size),
                    )
                )
        return _node_spec(x, dims)
    if isinstance(x, tuple):
        return tuple(_spec(v, dims, f"{path}[{i}]") for i, v in enumerate(x))
    if isinstance(x, list):
        return [_spec(v, dims, f"{path}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, Mapping):
        return {k: _spec(v, dims, f"{path}[{k!r}]") for k, v in x.items()}
    return None  # plain tensors and constants stay static


def dynamic_batch_shapes(inputs: Any, dims: Any = None) -> Any:
    """The ``dynamic_shapes`` argument of ``torch.export.export`` that marks the batch dims of
    every TensorDict / tensorclass in ``inputs`` as dynamic.

    Plain tensors outside containers stay static (combine the result with your own specs for
    them). Nested containers share the dims of the container holding them.

    Args:
        inputs: example inputs, as passed to ``torch.export.export`` (usually the ``args``
            tuple), or one container.
        dims: how to mark the batch dims: a ``torch.export.Dim`` (or ``Dim.DYNAMIC`` /
            ``Dim.AUTO``) for batch dim 0, or a mapping ``{batch_dim: Dim}``. Default:
            ``{0: Dim.DYNAMIC}``. A named ``Dim("batch")`` also asserts that every leaf has
            the same size there.

    Returns:
        A structure matching ``inputs`` to pass as ``dynamic_shapes``.

    Raises:
        ValueError: a dim in ``dims`` is not a batch dim of some container.

    Example:
        >>> import torch, tdfunc
        >>> class Policy(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(3, 2)
        ...     def forward(self, td):
        ...         return td.set("action", self.lin(td["obs"]))
        >>> td = tdfunc.TensorDict(obs=torch.randn(4, 3), batch_size=[4])
        >>> ep = torch.export.export(Policy(), (td,),
        ...                          dynamic_shapes=tdfunc.dynamic_batch_shapes((td,)))
        >>> big = tdfunc.TensorDict(obs=torch.randn(9, 3), batch_size=[9])
        >>> ep.module()(big)["action"].shape
        torch.Size([9, 2])
    """
    if dims is None:
        dims = {0: Dim.DYNAMIC}
    elif not isinstance(dims, Mapping):
        dims = {0: dims}
    return _spec(inputs, dims, "")


__all__ = ["dynamic_batch_shapes"]
