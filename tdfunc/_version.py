"""The version of tdfunc: its one home (``pyproject.toml`` reads it from here)."""

#: the version of this installation of tdfunc
__version__ = "0.1.0"
