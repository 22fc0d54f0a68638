"""Checkpoints on ``torch.distributed.checkpoint``: the operations (``api``) and the files,
manifest, commit and non-pickling reader (``store``). Imports only ``_common``."""
