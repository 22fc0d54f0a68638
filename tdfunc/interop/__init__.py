"""Interop with the rest of the ecosystem: safetensors files and ``tensordict`` objects.

* :func:`save_safetensors` / :func:`load_safetensors`: one safetensors file per container;
  leaves under their ``"."``-joined key paths (a module's ``state_dict()`` names), the
  structure as JSON metadata, zero-copy memory-mapped loading. No third-party package needed.
* :func:`from_tensordict` / :func:`to_tensordict`: conversion both ways with the
  ``tensordict`` package (optional), sharing the tensors.

The public names live at the top level (``tdfunc.save_safetensors``...); this package is
their implementation.
"""

__all__: list[str] = []
