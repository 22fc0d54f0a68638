"""Jagged leaves, in one place: variable-length data as ``torch.nested`` tensors of the jagged
layout inside containers.

The concept, module by module:

* :mod:`._layout` -- what a jagged leaf is and what tdfunc does with it: its kind asked under
  the ``torch.func`` / ``torch.vmap`` wrappers, rows of the batch gathered over values and
  offsets (indexing, ``cat``, ``split``), :class:`JaggedOpError` for what torch does not
  define, and the one check and builder of a jagged leaf read from a file
  (``jagged_problem`` / ``from_read_parts``).
* :mod:`._batch` -- samples of different lengths as one batch (``as_jagged``), jagged leaves
  as dense ones with masks and back (``to_padded`` with fixed lengths, multiples, truncation
  and a padding side; ``from_padded``), the DataLoader collate (``collate_jagged``).
* :mod:`._sampler` -- batches of similar lengths (``LengthGroupedSampler``), so that padded
  batches come in a handful of shapes.
* :mod:`._boundary` -- a jagged leaf at ``tdfunc.compile``'s boundary.

Public names are exported from :mod:`tdfunc`; nothing here is imported from outside the
package except through those names and the ``_layout`` helpers the ops use.
"""
