"""Pure functions over nodes (TensorDict and tensorclass): shape, combination, transforms,
arithmetic and reductions. Each takes nodes and returns new nodes; inputs are never changed.

Every function is written once against the node protocol of :mod:`tdfunc._tree`. The
functions live in one private module per concern and are all re-exported here, so callers
write ``from tdfunc import _ops as ops`` and ``ops.reshape``:

- :mod:`._structure`: batch-dim and structure checks, batch-size comparisons, flat names;
- :mod:`._shape`: shape ops over the batch dims (``reshape``, ``permute``, ``expand``...);
- :mod:`._indexing`: ``node[idx]``, indexed updates and ``td.at[idx]``;
- :mod:`._stack_split`: ``stack``, ``cat``, ``unbind``, ``split``, ``chunk``;
- :mod:`._transforms`: leafwise ``apply``, ``to``, ``clone``, ``*_like``, ``consolidate``;
- :mod:`._math`: elementwise arithmetic (``binary``, ``unary``);
- :mod:`._conveniences`: tensordict's everyday conveniences (``common_dtype``, ``tolist``,
  ``empty``, ``new_zeros``, ``pop``, ``split_keys``, ``rename_keys``...);
- :mod:`._batchdim`: torch functions over batch dims (reductions, scans, softmax, sorting,
  dim-wise shape and index ops, ``pad``), one rule per family (``_batchdim.rule_for``).

Module-level imports among them go one way: ``_structure`` <- ``_shape`` <- ``_stack_split``,
``_structure`` <- ``_math`` <- ``_indexing`` (which also uses ``_shape``), ``_structure`` <-
``_transforms``.
"""

from __future__ import annotations

# node-protocol helpers callers also reach as ``ops.X`` (``ops.leaves``)
from .._compat import check as check
from .._compat import foreach_add as foreach_add
from .._compat import foreach_div as foreach_div
from .._compat import foreach_mul as foreach_mul
from .._compat import foreach_sub as foreach_sub
from .._compat import is_batchedtensor as is_batchedtensor
from .._keys import KeyPath as KeyPath
from .._keys import fmt_key as fmt_key
from .._tree import Node as Node
from .._tree import is_node as is_node
from .._tree import leaves as leaves
from .._tree import leaves_with_paths as leaves_with_paths
from .._tree import map_leaves as map_leaves
from .._tree import same_structure as same_structure
from ._batchdim import all_, any_, reduce
from ._batchdim import common_layout as common_layout
from ._conveniences import KeySet as KeySet
from ._conveniences import common_dtype as common_dtype
from ._conveniences import empty as empty
from ._conveniences import filter_empty as filter_empty
from ._conveniences import get_at as get_at
from ._conveniences import is_empty as is_empty
from ._conveniences import new_empty as new_empty
from ._conveniences import new_full as new_full
from ._conveniences import new_ones as new_ones
from ._conveniences import new_tensor as new_tensor
from ._conveniences import new_zeros as new_zeros
from ._conveniences import numpy as numpy
from ._conveniences import pop as pop
from ._conveniences import rename_keys as rename_keys
from ._conveniences import sorted_keys as sorted_keys
from ._conveniences import split_keys as split_keys
from ._conveniences import tolist as tolist
from ._indexing import _ROW_DTYPES as _ROW_DTYPES
from ._indexing import AtIndexer, index, index_update
from ._indexing import _AtRef as _AtRef
from ._indexing import _dims_used as _dims_used
from ._indexing import _index_parts as _index_parts
from ._indexing import _is_row_gather as _is_row_gather
from ._indexing import normalize_index as normalize_index
from ._math import _COMMUTATIVE as _COMMUTATIVE
from ._math import _FOREACH as _FOREACH
from ._math import _can_foreach as _can_foreach
from ._math import _is_batched as _is_batched
from ._math import as_operand as as_operand
from ._math import binary, elementwise, unary
from ._shape import _batch_of as _batch_of
from ._shape import _infer_shape as _infer_shape
from ._shape import _map_shape as _map_shape
from ._shape import _probe as _probe
from ._shape import _shape_arg as _shape_arg
from ._shape import _wrap_dim as _wrap_dim
from ._shape import (
    expand,
    flatten,
    permute,
    reshape,
    squeeze,
    transpose,
    unflatten,
    unsqueeze,
    view,
)
from ._stack_split import _check_leaf_shapes as _check_leaf_shapes
from ._stack_split import _same_structure as _same_structure
from ._stack_split import _split_results as _split_results
from ._stack_split import cat, chunk, split, stack, unbind
from ._structure import _check_node as _check_node
from ._structure import _has_extra_dims as _has_extra_dims
from ._structure import _key_set as _key_set
from ._structure import _needs_a_batch_dim as _needs_a_batch_dim
from ._structure import _starts_with_batch_symbolic as _starts_with_batch_symbolic
from ._structure import _type_tree as _type_tree
from ._structure import check_batch_invariant as check_batch_invariant
from ._structure import known_equal as known_equal
from ._structure import match_operands as match_operands
from ._structure import match_structure as match_structure
from ._structure import norm_dim as norm_dim
from ._structure import put_flat as put_flat
from ._structure import starts_with_batch as starts_with_batch
from ._structure import to_state_dict as to_state_dict
from ._transforms import _ALIGN as _ALIGN
from ._transforms import _like as _like
from ._transforms import _parse_to as _parse_to
from ._transforms import (
    apply,
    clone,
    consolidate,
    contiguous,
    detach,
    empty_like,
    full_like,
    named_apply,
    ones_like,
    to,
    zeros_like,
)

__all__ = [
    "AtIndexer",
    "all_",
    "any_",
    "apply",
    "binary",
    "cat",
    "chunk",
    "clone",
    "consolidate",
    "contiguous",
    "detach",
    "elementwise",
    "empty_like",
    "expand",
    "flatten",
    "full_like",
    "index",
    "index_update",
    "named_apply",
    "ones_like",
    "permute",
    "reduce",
    "reshape",
    "split",
    "squeeze",
    "stack",
    "to",
    "transpose",
    "unary",
    "unbind",
    "unflatten",
    "unsqueeze",
    "view",
    "zeros_like",
]
