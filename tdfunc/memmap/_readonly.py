"""How a write into a read-only (``mode="r"``) leaf is refused, below the ATen schema check.

* ``tdfunc::refuse_write``: the ordered-effect custom op that raises the ``PermissionError``
  (at once in eager mode; under ``torch.compile``, when the compiled function runs);
* :class:`ReadOnlyStorage` / :class:`ReadOnlyTypedStorage` and :func:`protect`: the storages of
  a read-only leaf, whose own write methods raise ``PermissionError`` naming the file.

Which ops write is decided from their schemas in ``_op_rules.py``; the design is in
``_tensor.py`` ("How a write to a read-only leaf is refused").
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from .._compat import register_ordered_effect
from . import _errors as E


# --------------------------------------------------------------------------------------
# refusing writes: an ordered-effect custom op (raises when it runs, eager or compiled)
# --------------------------------------------------------------------------------------
@torch.library.custom_op("tdfunc::refuse_write", mutates_args=())
def _refuse_write(x: Tensor, filename: str, op: str) -> None:
    raise PermissionError(E.READ_ONLY.format(filename=filename, op=op))


@_refuse_write.register_fake
def _refuse_write_fake(x: Tensor, filename: str, op: str) -> None:
    return None


register_ordered_effect(_refuse_write)


def protect(t: Tensor, mode: str, filename: str) -> Tensor:
    """Mark the storage of a read-only leaf's tensor so that its own write methods refuse."""
    if mode == "r":
        s = t.untyped_storage()
        if type(s) is torch.UntypedStorage:
            s.__class__ = ReadOnlyStorage
            cast(ReadOnlyStorage, s)._readonly_filename = filename
    return t


# --------------------------------------------------------------------------------------
# read-only storages: their own write methods refuse, naming the file
# --------------------------------------------------------------------------------------
#: storage methods that write; on a read-only leaf's storages each raises PermissionError
_STORAGE_WRITES = ("copy_", "fill_", "zero_", "__setitem__", "resize_", "byteswap")
#: more writes that only untyped storages have (file and shared-memory plumbing)
_UNTYPED_STORAGE_WRITES = ("_set_from_file", "_share_fd_cpu_", "_share_filename_cpu_")


def _refusing(op: str) -> Any:
    """A storage method that refuses ``op``, naming the read-only file."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        untyped = self if isinstance(self, ReadOnlyStorage) else self._untyped_storage
        raise PermissionError(
            E.READ_ONLY.format(filename=untyped._readonly_filename, op=f"storage {op}")
        )

    refuse.__name__ = op
    return refuse


class ReadOnlyStorage(torch.UntypedStorage):
    """The storage of a read-only leaf: reads work; every method that writes raises
    ``PermissionError`` naming the file (``share_memory_`` is a no-op: the data is shared by
    file reference)."""

    _readonly_filename: str  # set when a storage becomes read-only

    def share_memory_(self) -> Any:
        return self


class ReadOnlyTypedStorage(torch.TypedStorage):
    """``leaf.storage()`` of a read-only leaf: reads work, writes raise ``PermissionError``."""

    def share_memory_(self) -> Any:
        return self


for _op in (*_STORAGE_WRITES, *_UNTYPED_STORAGE_WRITES):
    setattr(ReadOnlyStorage, _op, _refusing(_op))
for _op in _STORAGE_WRITES:
    setattr(ReadOnlyTypedStorage, _op, _refusing(_op))
del _op
