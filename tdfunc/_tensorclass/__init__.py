"""The ``@tensorclass`` decorator (private package; the public name is ``tdfunc.tensorclass``).

* ``_fields.py``  field specs: annotations -> what a field may hold, conversion and checks
* ``_codegen.py`` generated ``__init__`` and trusted constructors (registered in ``linecache``)
* ``_class.py``   the shared base class, the decorator and ``is_tensorclass``
"""

from ._class import is_tensorclass, restore, tensorclass

__all__ = ["is_tensorclass", "restore", "tensorclass"]
