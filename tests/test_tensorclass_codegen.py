"""The generated code of ``@tensorclass``: its exact source for one small class, and its lines
in tracebacks, ``inspect.getsource`` and ``linecache`` (so ``pdb`` shows them too)."""

from __future__ import annotations

import inspect
import linecache
import re
import traceback

import pytest
import torch
from helpers import check_compiled

from tdfunc import _errors as E
from tdfunc import tensorclass


@tensorclass
class Pin:
    x: torch.Tensor
    n: int = 3


PIN_SOURCE = r"""def __init__(__tdf_self__, x=__tdf_REQUIRED__, n=__tdf_default_n__, *__tdf_extra__, batch_size=(), device=None, **__tdf_unknown__):
    if __tdf_extra__:
        __tdf_too_many__(__tdf_cls__, 2, ['x', 'n'], __tdf_extra__)
    if __tdf_unknown__:
        __tdf_unknown_fn__(__tdf_cls__, '()', __tdf_unknown__)
    __tdf_bs__ = __tdf_as_size__(batch_size)
    __tdf_dev__ = __tdf_as_device__(device)
    if x is __tdf_REQUIRED__:
        __tdf_missing__(__tdf_cls__, 'x')
    __tdf_object__.__setattr__(__tdf_self__, 'x', __tdf_child__(__tdf_cls__, 'x', x, __tdf_bs__, __tdf_dev__, __tdf_spec_x__))
    __tdf_object__.__setattr__(__tdf_self__, 'n', __tdf_static__(__tdf_cls__, 'n', n, __tdf_ann_n__))
    __tdf_object__.__setattr__(__tdf_self__, '_batch_size', __tdf_bs__)
    __tdf_object__.__setattr__(__tdf_self__, '_device', __tdf_dev__)

def _tdf_rebuild(__tdf_self__, children, batch_size, device):
    __tdf_new__ = __tdf_object__.__new__(__tdf_cls__)
    __tdf_c0__, = children
    __tdf_object__.__setattr__(__tdf_new__, 'x', __tdf_c0__)
    __tdf_object__.__setattr__(__tdf_new__, 'n', __tdf_self__.n)
    __tdf_object__.__setattr__(__tdf_new__, '_batch_size', batch_size)
    __tdf_object__.__setattr__(__tdf_new__, '_device', device)
    return __tdf_new__

def __tdf_unflatten__(keys, children, batch_size, device, static):
    __tdf_new__ = __tdf_object__.__new__(__tdf_cls__)
    __tdf_c0__, = children
    __tdf_object__.__setattr__(__tdf_new__, 'x', __tdf_c0__)
    __tdf_object__.__setattr__(__tdf_new__, 'n', static[0][1])
    __tdf_object__.__setattr__(__tdf_new__, '_batch_size', batch_size)
    __tdf_object__.__setattr__(__tdf_new__, '_device', device)
    return __tdf_new__

def replace(__tdf_self__, *, x=__tdf_KEEP__, n=__tdf_KEEP__, **__tdf_unknown__):
    'A new instance with the given fields changed, checked like the constructor; batch_size and device are kept and __post_init__ is not re-run.'
    if __tdf_unknown__:
        __tdf_unknown_fn__(__tdf_cls__, '.replace()', __tdf_unknown__)
    __tdf_bs__ = __tdf_self__._batch_size
    __tdf_dev__ = __tdf_self__._device
    __tdf_new__ = __tdf_object__.__new__(__tdf_cls__)
    if x is __tdf_KEEP__:
        __tdf_object__.__setattr__(__tdf_new__, 'x', __tdf_self__.x)
    else:
        __tdf_object__.__setattr__(__tdf_new__, 'x', __tdf_child__(__tdf_cls__, 'x', x, __tdf_bs__, __tdf_dev__, __tdf_spec_x__))
    if n is __tdf_KEEP__:
        __tdf_object__.__setattr__(__tdf_new__, 'n', __tdf_self__.n)
    else:
        __tdf_object__.__setattr__(__tdf_new__, 'n', __tdf_static__(__tdf_cls__, 'n', n, __tdf_ann_n__))
    __tdf_object__.__setattr__(__tdf_new__, '_batch_size', __tdf_bs__)
    __tdf_object__.__setattr__(__tdf_new__, '_device', __tdf_dev__)
    return __tdf_new__

def _tdf_children(__tdf_self__):
    return (__tdf_self__.x,)

def _tdf_static(__tdf_self__):
    return (('n', __tdf_self__.n),)
"""


def _filename(cls: type) -> str:
    return cls.__init__.__code__.co_filename


def _generated_frame(exc: BaseException, filename: str) -> traceback.FrameSummary:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    assert len(frames) == 1, f"expected one frame in {filename}, got {frames}"
    return frames[0]


def test_generated_source_of_a_small_class_is_pinned():
    filename = _filename(Pin)
    assert filename == f"<tensorclass {Pin.__module__}.Pin>"
    assert "".join(linecache.getlines(filename)) == PIN_SOURCE
    # every generated function compiled from that one source
    for name in ("__init__", "_tdf_rebuild", "replace", "_tdf_children", "_tdf_static"):
        assert getattr(Pin, name).__code__.co_filename == filename


def test_inspect_getsource_shows_each_generated_function():
    init = PIN_SOURCE.split("\n\n")[0] + "\n"
    assert inspect.getsource(Pin.__init__) == init
    assert inspect.getsource(Pin._tdf_children) == (
        "def _tdf_children(__tdf_self__):\n    return (__tdf_self__.x,)\n"
    )
    assert inspect.getsource(Pin.replace).startswith("def replace(__tdf_self__, *, x=__tdf_KEEP__")


def test_traceback_through_generated_init_shows_the_missing_field_line():
    with pytest.raises(TypeError, match=re.escape("missing required field 'x'")) as info:
        Pin()
    frame = _generated_frame(info.value, _filename(Pin))
    assert frame.name == "__init__"
    assert frame.line == "__tdf_missing__(__tdf_cls__, 'x')"
    assert (
        frame.lineno
        == PIN_SOURCE.splitlines().index("        __tdf_missing__(__tdf_cls__, 'x')") + 1
    )
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{_filename(Pin)}", line {frame.lineno}, in __init__' in text
    assert "    __tdf_missing__(__tdf_cls__, 'x')\n" in text


def test_traceback_through_generated_init_shows_the_field_check_line():
    with pytest.raises(ValueError, match=re.escape("Pin: field 'x' has shape (2,)")) as info:
        Pin(torch.zeros(2), batch_size=[3])
    frame = _generated_frame(info.value, _filename(Pin))
    assert frame.line is not None
    assert frame.line.startswith("__tdf_object__.__setattr__(__tdf_self__, 'x', __tdf_child__(")
    # the failing call is the generated child check; the message names the field
    assert frame.name == "__init__"


def test_traceback_through_generated_replace_shows_the_line():
    p = Pin(torch.zeros(3), batch_size=[3])
    with pytest.raises(TypeError, match=re.escape("'y'")) as info:
        p.replace(y=1)
    frame = _generated_frame(info.value, _filename(Pin))
    assert frame.name == "replace"
    assert frame.line == "__tdf_unknown_fn__(__tdf_cls__, '.replace()', __tdf_unknown__)"


def _make_class(second_field: str) -> type:
    # the same qualified name on every call, with other fields
    namespace = {"__annotations__": {"x": torch.Tensor, second_field: torch.Tensor}}
    return tensorclass(type("Twin", (), namespace))


def test_classes_of_the_same_name_get_their_own_source():
    a, b = _make_class("left"), _make_class("right")
    assert a.__qualname__ == b.__qualname__
    fa, fb = _filename(a), _filename(b)
    assert fa != fb
    assert fa.startswith(f"<tensorclass {a.__module__}.Twin")
    assert fb.startswith(f"<tensorclass {b.__module__}.Twin-")
    assert "'left'" in inspect.getsource(a.__init__)
    assert "'right'" not in inspect.getsource(a.__init__)
    assert "'right'" in inspect.getsource(b.__init__)
    # the first class's lines are not replaced by the second's
    assert "".join(linecache.getlines(fa)).count("'left'") > 0
    assert "".join(linecache.getlines(fa)).count("'right'") == 0


def test_source_survives_linecache_checkcache():
    linecache.checkcache()
    linecache.checkcache(_filename(Pin))
    assert "".join(linecache.getlines(_filename(Pin))) == PIN_SOURCE


def test_error_texts_used_by_the_generated_code_are_the_shared_constants():
    expected = E.TOO_MANY_POSITIONAL.format(cls="Pin", n=2, names=("x", "n"), got=3)
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        Pin(torch.zeros(3), 4, 5, batch_size=[3])


def test_generated_init_and_replace_compile_fullgraph():
    def fn(x: torch.Tensor) -> Pin:
        p = Pin(x, 5, batch_size=[x.shape[0]])
        return p.replace(x=p.x * 2)

    cnt = check_compiled(fn, lambda: (torch.randn(4, 2),))
    assert cnt.frame_count == 1
