"""Transfers between groups of ranks: the planner between two meshes (``plan``), the handshake
and packing of a planned transfer (``handshake``), the reusable ``Transfer`` (``session``) and
``send`` / ``recv`` (``p2p``). Imports ``_common`` and ``_redistribute`` (a source reduces
``Partial`` leaves, ``send`` gathers full tensors)."""
