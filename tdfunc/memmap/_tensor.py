"""``MemoryMappedTensor``: a tensor leaf backed by a file, whose mode is part of the leaf.

How a write to a read-only (``mode="r"``) leaf is refused
--------------------------------------------------------
Two independent layers, so that no code path can change the file or crash the process:

1. **Python level, every tensor method.** ``MemoryMappedTensor`` is a *traceable wrapper
   subclass*: it holds a plain tensor ``_inner`` over the mapped bytes and implements
   ``__torch_dispatch__``. Every ATen op that reaches it is checked against the op's schema:
   an argument whose alias annotation says ``is_write`` (``add_``, ``copy_``, ``fill_``,
   ``index_put_`` from ``x[i] = v``, ``out=`` arguments, ``_foreach_*_``...) that is a read-only
   leaf is refused *before* the op runs. The schema is the single source of truth, so no
   list of method names can go stale. Views (indexing, ``view``, ``unbind``, ``detach``...) are
   recognised from the same alias annotations and stay ``MemoryMappedTensor`` with the mode of
   their source, so a write through a view is refused too; every other result is a plain
   tensor.
2. **OS level, everything else.** A read-only leaf is a *private* (copy-on-write,
   ``MAP_PRIVATE``) mapping of a file opened ``O_RDONLY``. Code that bypasses tensor methods
   (``torch.from_numpy(leaf.numpy())``, ``ctypes``, a C extension) can at worst change
   process-private pages: the file is never touched and, since the pages are writable, nothing
   segfaults. ``leaf.numpy()`` of a read-only leaf also returns a non-writeable array, so
   numpy itself refuses the write. (A shared read-only ``PROT_READ`` mapping, as ``numpy.memmap``
   and an early tensordict used, segfaults on such writes.)

Reads without ``__torch_dispatch__``
-----------------------------------
torch imports ``torch.distributed.tensor`` (about 0.7 s, sympy included) the first time any
op is dispatched to a Python ``__torch_dispatch__`` in a process: before calling the handler,
its C++ dispatcher (``dispatch_on_subclass`` in ``python_arg_parser.cpp``) asks whether the
argument is a ``DTensor``, and looking up that class imports it. Every new process (each
DataLoader worker) paid it on its first read of a leaf, whatever the size. So a call first
meets ``MemoryMappedTensor.__torch_function__``, which decides from the ATen schemas alone
(no list of method names): a C binding of an ATen op none of whose overloads writes an input
(``sum``, ``x[i]``, ``x + 1``, ``view``, ``index_select``, ``torch.stack``...) and passed no
``out=`` argument runs directly on the plain mapped tensors, no Python dispatch involved; a
result that shares memory with a leaf (``torch._C._is_alias_of``: a view, or the mapped tensor
itself, as ``x.to(x.dtype)`` returns) is wrapped again as a leaf with that leaf's file and mode,
so a write through it is refused as before. Everything else (in-place and ``out=`` calls,
Python-level functions such as ``torch.nn.init.normal_`` or ``F.relu(x, inplace=True)``, names
that are not ATen ops such as ``__setitem__``) goes on to ``__torch_dispatch__`` and its per-op
check below. While ``torch.compile`` traces, the leaves hold fake or functional tensors and
every call takes the checked way, as before. A fresh process thus reads a store at
``numpy.memmap``'s speed (``compile_benchmarks/test_bench_memmap.py``,
``memmap_first_read_fresh``).

The refusal is raised by a tiny custom op, ``tdfunc::refuse_write``, registered as an *ordered
effect*. In eager mode it raises at once. Under ``torch.compile`` it is recorded in the graph
(its fake kernel does nothing), kept by dead-code elimination and ordered before the write, so
the *compiled* function raises the same ``PermissionError`` naming the file when it runs, with
the ``eager``, ``aot_eager`` and ``inductor`` backends alike. (Raising while tracing would
reach the user as Dynamo's ``TorchRuntimeError``, not as a ``PermissionError``.)

Why a wrapper subclass and not a plain ``torch.Tensor`` subclass
---------------------------------------------------------------
tensordict's ``MemoryMappedTensor`` is a plain subclass (``_make_subclass``) with
``__torch_function__`` disabled. Under ``aot_eager`` the compiled function's first call runs
under an aliasing check mode (``_AnalyzeCustomOpInputOutputMode``) that returns
``NotImplemented`` for any tensor type it does not know, so the first call fails unless the
process-wide ``torch._functorch.config.check_custom_op_aliasing`` is turned off. A traceable
wrapper subclass (``__tensor_flatten__`` / ``__tensor_unflatten__``) is unwrapped by AOTAutograd
at the compile boundary: the compiled graph only ever sees the plain inner tensor, so all three
backends work from the first call with no global setting.

Compile guards
--------------
``__tensor_flatten__`` returns ``(filename, mode, offset)`` as metadata, which Dynamo guards
on. A compiled function therefore compiles once per (store file, mode): the metadata is needed
to rebuild views returned by the compiled function with the right file (AOTAutograd rebuilds
output subclasses from the traced metadata; with the file left out of the guard, a view
returned for store B was labelled with store A's file) and to name the file in the error.
Calling the compiled function on new data saved at the same path does not recompile.

Mapping
-------
The whole file is mapped once with libc's ``mmap`` on an open descriptor (``MAP_SHARED`` for
``"r+"``; ``MAP_PRIVATE | MAP_NORESERVE`` otherwise, from a read-only descriptor) and wrapped as
one storage; the descriptor is closed after mapping, so many mapped leaves do not use up
descriptors (``_mapping.map_fd``). Each leaf gets a storage *of its own*: a slice of that mapping that
covers exactly the leaf's bytes and keeps the mapping alive. This matters under
``torch.compile``: functionalizing an in-place write clones "the whole storage" of the written
input (``clone_preserve_strides``); with one storage for the whole file that would copy the
whole store for a one-row write (and it asserts when the file size is not a multiple of the
dtype's size). A leaf records the file offset of its storage, so pickling by reference is
exact: ``(filename, mode, offset, nbytes, dtype, shape, stride, storage offset)``.

Where the code lives
--------------------
This module holds the design notes above and is the stable import path of the leaf and its
helpers (``tdfunc.memmap._store``, ``tdfunc.interop`` and pickles made by earlier versions
import from it); the code is in these modules, each importing only those listed before it:

* ``_leafspec.py``: modes, dtypes (manifest names), shapes, byte sizes and their checks;
* ``_readonly.py``: the ``tdfunc::refuse_write`` effect op and the read-only storages;
* ``_op_rules.py``: what an ATen op or torch function does to leaves, from its schemas;
* ``_mapping.py``: opening and ``mmap``-ing files, the tensor over one leaf's bytes;
* ``_writing.py``: durable file writes (chunked tensor bytes, reserve, fsync, atomic create);
* ``_pickling.py``: ``remap``, which maps a pickled leaf's file again;
* ``_memory_mapped_tensor.py``: the ``MemoryMappedTensor`` class and its dispatch plumbing,
  ``_rebuild`` (the unpickling function pickles name: ``remap`` + the wrap) and
  ``write_tensor`` (a plain tensor or a leaf, unwrapped, through ``_writing.write_plain``).

No module imports one listed after it, not even inside a function.
"""

from __future__ import annotations

# every name below is re-exported: the module's own code is in the modules it imports
# ruff: noqa: F401
from ._leafspec import (
    DTYPE_NAMES,
    DTYPES,
    MODES,
    as_shape,
    check_leaf,
    check_mode,
    dtype_name,
    nbytes_of,
)
from ._mapping import (
    _MAP_FAILED,
    _O_CLOEXEC,
    MAP_NORESERVE,
    _libc,
    _Mapping,
    _permission_error,
    identity,
    leaf_tensor,
    map_fd,
    mapped_identity,
    open_fd,
)
from ._memory_mapped_tensor import (
    MemoryMappedTensor,
    _plain_args,
    _rebuild,
    _refuse_if_read_only,
    _result,
    _rewrap,
    _rewrap_aliases,
    _unwrap,
    write_tensor,
)
from ._op_rules import (
    _BUILTINS,
    _CHECKED,
    _KINDS,
    _META,
    _METADATA,
    _OPERATORS,
    _PLAIN,
    _READ,
    _VIEW,
    _WRITE,
    _arg,
    _kind,
    _mapped,
    _op_info,
)
from ._pickling import (
    _store_id_at,
    remap,
)
from ._readonly import (
    _STORAGE_WRITES,
    _UNTYPED_STORAGE_WRITES,
    ReadOnlyStorage,
    ReadOnlyTypedStorage,
    _refuse_write,
    _refuse_write_fake,
    _refusing,
    protect,
)
from ._writing import (
    CHUNK,
    _atomic_file,
    _host_chunks,
    create_unique,
    fsync_dir,
    reserve,
    write_all,
    write_plain,
)
