"""Memory-mapped storage: TensorDicts and tensorclasses larger than RAM, living on disk.

* :class:`MemoryMappedTensor`: a tensor leaf backed by a file. Its ``mode`` is part of the
  leaf: ``"r"`` read-only, ``"r+"`` read-write, ``"c"`` copy-on-write.
* :func:`save` / :func:`load` / :func:`memmap_like`: whole containers as a directory with a
  versioned JSON manifest and one aligned data file; atomic saves; no pickle.

Design decisions (details in ``_tensor.py`` and ``_store.py``):

Read-only means read-only
    A write into a ``"r"`` leaf by any tensor method raises ``PermissionError`` naming the
    file, eagerly and inside compiled functions, before anything is written. The check reads
    each ATen op's schema (``alias_info.is_write``), so ``add_``, ``copy_``, ``fill_``,
    ``x[i] = v``, ``out=`` and ``_foreach_*_`` are all covered, also through views, which keep
    the mode of their source. Paths that bypass tensor methods (``.numpy()``, ``ctypes``)
    cannot reach the file either: a read-only file is opened ``O_RDONLY`` and mapped privately
    (copy-on-write), so the worst such code can do is change process-private memory; it never
    segfaults and never changes the file. (tensordict's first version segfaulted on such a
    write; its later version maps read-only files privately and silently drops the write.)

Reads at ``numpy.memmap``'s speed from the first one
    A call whose ATen schemas write nothing (``sum``, indexing, arithmetic, views) runs
    directly on the plain mapped tensors, decided in ``__torch_function__``; results that
    share a leaf's memory are leaves with its mode again. Only other calls reach the per-op
    check of ``__torch_dispatch__``, whose first use in a process makes torch import
    ``torch.distributed.tensor`` (~0.7 s): a DataLoader worker's first read no longer pays it.

Compile from the first call, with no global setting
    The leaf is a traceable wrapper subclass: AOTAutograd unwraps it to its plain inner tensor
    at the compile boundary, so the ``eager``, ``aot_eager`` and ``inductor`` backends all
    work from the first call. (tensordict's plain subclass fails the first ``aot_eager`` call:
    an aliasing check mode rejects unknown tensor types unless
    ``torch._functorch.config.check_custom_op_aliasing`` is turned off process-wide.) The
    refusal itself is an ordered-effect custom op, so a compiled function that writes into a
    read-only leaf raises the same ``PermissionError`` when called. A compiled function
    guards on each leaf's file, mode and offset: it compiles once per store and mode, and new
    data saved at the same path does not recompile. Batches indexed out of a store with a
    tensor index (``store[idx]``) are plain tensors, so a compiled training step that takes
    such batches never depends on the store at all. Creating memory maps (file I/O) is not traceable:
    call ``save`` / ``load`` outside compiled functions.

Sharing between processes
    Pickling a leaf (or a container of them) sends the file name, mode, dtype, shape, strides
    and offset, not the data; the receiver maps the file again. ``"r+"`` mappings are shared,
    so a DataLoader worker's writes are visible to the parent. A ``"c"`` leaf is also pickled by
    reference: its private in-memory changes stay in the process that made them.

Example:
    >>> import os, tempfile, torch, tdfunc
    >>> path = os.path.join(tempfile.mkdtemp(), "dataset")
    >>> tdfunc.save(tdfunc.TensorDict(x=torch.randn(100, 4), y=torch.zeros(100),
    ...                               batch_size=[100]), path)
    >>> data = tdfunc.load(path)                  # read-only, nothing read yet
    >>> batch = data[torch.arange(10)]            # reads 10 rows
    >>> batch["x"].shape, type(data["x"]).__name__, data["x"].mode
    (torch.Size([10, 4]), 'MemoryMappedTensor', 'r')
"""

from .. import _deprecate
from . import _errors, _store, _tensor

# The public names of this package live at the top level (tdfunc.save, tdfunc.load, ...);
# the paths tdfunc.memmap.<name> are kept for one release.
__getattr__ = _deprecate.module_getattr(
    __name__,
    {
        name: (_deprecate.attribute(m, name), f"tdfunc.{name}")
        for m, names in (
            (_errors, ("MemmapFormatError", "StoreCleanupWarning", "StoreReplacedError")),
            (_store, ("load", "memmap_like", "save")),
            (_tensor, ("MemoryMappedTensor",)),
        )
        for name in names
    },
)

__all__: list[str] = []
