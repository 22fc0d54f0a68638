"""Training over a mesh: the sharded data-parallel step (uses ``_common``; nothing imports it
but the package's public face)."""
