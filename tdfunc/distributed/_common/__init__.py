"""What the jobs of :mod:`tdfunc.distributed` share: error messages, placements and their JSON
codec, mesh checks, agreement between ranks, the wire format of point-to-point messages, the
cache registry and the multi-process launcher. Imports no job package (``_redistribute``,
``_transfer``, ``_checkpoint``); ``tests/test_import_graph.py`` checks it."""
