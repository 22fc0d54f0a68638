"""Redistribution on one mesh: ``distribute`` / ``from_local`` / ``to_local`` (``local``), the
coalesced redistribution plans (``plan``) and ``redistribute`` / ``full_tensor`` as cached
compiled graphs (``redistribute``). Imports only ``_common``."""
