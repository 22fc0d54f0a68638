"""``tdfunc._compat``: the one home of private torch APIs.

* a guard: no module of ``tdfunc`` but ``_compat.py`` uses a private torch name in code;
* one test per shim: it exists on this torch and does what its callers rely on.
"""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import token
import tokenize
from pathlib import Path

import pytest
import torch
from torch import nn

import tdfunc
from tdfunc import _compat as C

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tdfunc"
COMPAT = PACKAGE / "_compat.py"

_COMPAT_ROOT = "<compat>"  # alias root of names taken from tdfunc._compat
_SKIP = frozenset({token.COMMENT, token.NL, token.INDENT, token.DEDENT, token.ENCODING})


# --------------------------------------------------------------------------------------
# the guard
# --------------------------------------------------------------------------------------
def _is_private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def _bad(path: str) -> bool:
    """Whether a resolved dotted path uses a private torch name (or a private name of
    ``_compat`` itself: its public names are the interface)."""
    parts = path.split(".")
    if parts[0] == _COMPAT_ROOT:
        return any(map(_is_private, parts[1:]))
    return parts[0] == "torch" and any(map(_is_private, parts[1:]))


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of each use of a private torch name in the code of ``source``.

    Strings, docstrings and comments are not code: the source is tokenized and dotted names
    are rebuilt from NAME and ``.`` tokens. Imports are checked (``import torch._x``,
    ``from torch.a._b import c``, ``from torch.a import _c``) and record the names they bind,
    so ``nn._x`` after ``from torch import nn`` and ``pytree.f`` after
    ``import torch.utils._pytree as pytree`` are uses of ``torch.nn._x`` and
    ``torch.utils._pytree.f``. Names bound from ``tdfunc._compat`` are checked for private
    attributes too (``pytree._x`` after ``from ._compat import pytree``).
    """
    toks = [
        t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in _SKIP
    ]
    aliases: dict[str, str] = {}
    found: list[tuple[int, str]] = []

    def dotted(i: int) -> tuple[list[str], int]:
        names = [toks[i].string]
        i += 1
        while (
            i + 1 < len(toks)
            and toks[i].type == token.OP
            and toks[i].string == "."
            and toks[i + 1].type == token.NAME
        ):
            names.append(toks[i + 1].string)
            i += 2
        return names, i

    def report(line: int, path: str) -> None:
        hit = (line, path.replace(_COMPAT_ROOT, "tdfunc._compat"))
        if _bad(path) and hit not in found:
            found.append(hit)

    i = 0
    n = len(toks)
    while i < n:
        tok = toks[i]
        prev = toks[i - 1] if i else None
        at_start = prev is None or prev.type == token.NEWLINE or prev.string in (";", ":")
        if tok.type == token.NAME and tok.string == "import" and at_start:
            i += 1
            while i < n and toks[i].type == token.NAME:
                names, i = dotted(i)
                module = ".".join(names)
                report(tok.start[0], module)
                if i < n and toks[i].string == "as":
                    aliases[toks[i + 1].string] = module
                    i += 2
                else:
                    aliases[names[0]] = names[0]
                if i < n and toks[i].string == ",":
                    i += 1
            continue
        if tok.type == token.NAME and tok.string == "from" and at_start:
            i += 1
            dots = 0
            while toks[i].type == token.OP and set(toks[i].string) == {"."}:
                dots += len(toks[i].string)
                i += 1
            names: list[str] = []
            if toks[i].type == token.NAME and toks[i].string != "import":
                names, i = dotted(i)
            module = ".".join(names)
            i += 1  # "import"
            if module == "torch" or module.startswith("torch."):
                base = module
            elif names and names[-1] == "_compat" and (dots or names[0] == "tdfunc"):
                base = _COMPAT_ROOT
            else:
                base = ""
            if base:
                report(tok.start[0], base)
            module_bad = bool(base) and _bad(base)
            while i < n and toks[i].type != token.NEWLINE and toks[i].string != ";":
                t = toks[i]
                if t.type == token.NAME:
                    if base:
                        path = f"{base}.{t.string}"
                    elif t.string == "_compat" and (dots or module == "tdfunc"):
                        path = _COMPAT_ROOT
                    else:
                        path = ""
                    bound = t.string
                    if i + 2 < n and toks[i + 1].string == "as":
                        bound = toks[i + 2].string
                        i += 2
                    if path:
                        if not module_bad:
                            report(t.start[0], path)
                        aliases[bound] = path
                    else:
                        aliases.pop(bound, None)
                i += 1
            continue
        if tok.type == token.NAME and not (prev is not None and prev.string == "."):
            names, j = dotted(i)
            root = aliases.get(names[0])
            if root is not None:
                report(tok.start[0], ".".join([root, *names[1:]]))
            i = j
            continue
        i += 1
    return found


def test_the_guard_reads_code_not_prose():
    src = '''"""torch._dynamo in a docstring is prose."""
import torch
import torch._dynamo
import torch.utils._pytree as pytree
from torch import nn, Tensor as T
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.nn.utils.stateless import _reparametrize_module
from torch import _dynamo
from .. import _compat as C
from .._compat import pytree as p, foreach_add
x = "torch._C._functorch"  # torch._check in a comment
y = torch.nn.functional.relu(torch.ones(1))
z = torch._foreach_add(a, b)
w = torch.ops.aten._lazy_clone.default
v = nn.modules.batchnorm._NormBase
u = T._make_wrapper_subclass
s = pytree.tree_map
r = C.foreach_add(p.tree_map, foreach_add)
q = C._private + p._private
o = torch.__version__
def f():
    raise ValueError("x") from None
'''
    assert private_torch_uses(src) == [
        (3, "torch._dynamo"),
        (4, "torch.utils._pytree"),
        (6, "torch.utils._python_dispatch"),
        (7, "torch.nn.utils.stateless._reparametrize_module"),
        (8, "torch._dynamo"),
        (13, "torch._foreach_add"),
        (14, "torch.ops.aten._lazy_clone.default"),
        (15, "torch.nn.modules.batchnorm._NormBase"),
        (16, "torch.Tensor._make_wrapper_subclass"),
        (17, "torch.utils._pytree.tree_map"),
        (19, "tdfunc._compat._private"),
        (19, "tdfunc._compat.pytree._private"),
    ]


def test_no_private_torch_name_outside_compat():
    """Every private torch API used by tdfunc goes through ``tdfunc/_compat.py``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        rel = path.relative_to(ROOT)
        for line, name in private_torch_uses(path.read_text()):
            found.append(f"{rel}:{line}: {name}")
    assert not found, (
        f"{len(found)} uses of private torch names outside tdfunc/_compat.py "
        "(add a shim there and use it):\n" + "\n".join(found)
    )


# --------------------------------------------------------------------------------------
# the shims
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", C.__all__)
def test_every_shim_exists_on_this_torch(name):
    value = getattr(C, name)
    assert not hasattr(value, "__tdfunc_missing__"), f"{name}: {value.__tdfunc_missing__}"


def test_versions():
    assert isinstance(C.TORCH_VERSION, tuple)
    assert len(C.TORCH_VERSION) == 3
    assert all(isinstance(v, int) for v in C.TORCH_VERSION)
    assert C.TORCH_VERSION[:2] == tuple(int(v) for v in torch.__version__.split(".")[:2])
    assert C.MIN_TORCH == (2, 13)
    assert C.TORCH_VERSION >= C.MIN_TORCH
    assert C._parse_version("2.15.0a0+git1234") == (2, 15, 0)
    assert C._parse_version("2.16.0.dev20260101+cu130") == (2, 16, 0)
    assert C._parse_version("2.14") == (2, 14, 0)


def test_missing_names_the_feature_and_the_minimum_version():
    with pytest.raises(RuntimeError, match=r"frobnication .*torch >= 2\.99") as info:
        C.missing("frobnication (torch._frob)", "2.99")
    assert torch.__version__ in str(info.value)


def test_a_missing_function_fails_when_called_not_when_resolved():
    f = C._function(lambda: torch._no_such_internal, "frobnication")  # type: ignore[attr-defined]
    assert f.__tdfunc_missing__ == "frobnication"
    with pytest.raises(RuntimeError, match=r"frobnication .*torch >= 2\.13"):
        f(1, key=2)


def test_a_missing_class_fails_when_used_not_when_resolved():
    cls = C._class(lambda: torch._C._NoSuchClass, "frob classes")  # type: ignore[attr-defined]
    assert cls.__tdfunc_missing__ == "frob classes"
    with pytest.raises(RuntimeError, match="frob classes"):
        cls()
    with pytest.raises(RuntimeError, match="frob classes"):
        isinstance(1, cls)
    with pytest.raises(RuntimeError, match="frob classes"):
        issubclass(int, cls)


def test_a_missing_lazy_class_fails_when_used(monkeypatch):
    monkeypatch.setitem(C._LAZY, "Nope", ("torch.no_such_module", "Nope", "nothing at all"))
    try:
        with pytest.raises(RuntimeError, match=r"nothing at all \(torch\.no_such_module\.Nope\)"):
            C.Nope()
    finally:
        vars(C).pop("Nope", None)
    with pytest.raises(AttributeError):
        C.no_such_shim  # noqa: B018


def test_pytree_round_trips_a_dict():
    import torch.utils._pytree as torch_pytree

    assert C.pytree is torch_pytree
    tree = {"a": torch.ones(2), "b": {"c": torch.zeros(1)}}
    flat, spec = C.pytree.tree_flatten(tree)
    assert len(flat) == 2
    back = C.pytree.tree_unflatten(flat, spec)
    assert back.keys() == tree.keys()
    assert back["b"]["c"] is tree["b"]["c"]
    td = tdfunc.TensorDict(a=torch.ones(2))
    assert C.pytree.tree_unflatten(*C.pytree.tree_flatten(td)).keys() == ["a"]


def _lists():
    xs = [torch.tensor([1.0, 4.0]), torch.tensor([9.0])]
    ys = [torch.tensor([2.0, -2.0]), torch.tensor([3.0])]
    zs = [torch.tensor([4.0, 8.0]), torch.tensor([1.0])]
    return xs, ys, zs


_FOREACH_CASES = {
    "foreach_add": (lambda x, y, z: C.foreach_add(x, y, alpha=2), lambda x, y, z: x + 2 * y),
    "foreach_add_": (lambda x, y, z: C.foreach_add_(x, 1.5) or x, lambda x, y, z: x + 1.5),
    "foreach_sub": (lambda x, y, z: C.foreach_sub(x, y), lambda x, y, z: x - y),
    "foreach_mul": (lambda x, y, z: C.foreach_mul(x, y), lambda x, y, z: x * y),
    "foreach_mul_": (lambda x, y, z: C.foreach_mul_(x, 3.0) or x, lambda x, y, z: x * 3),
    "foreach_div": (lambda x, y, z: C.foreach_div(x, y), lambda x, y, z: x / y),
    "foreach_div_": (lambda x, y, z: C.foreach_div_(x, 2.0) or x, lambda x, y, z: x / 2),
    "foreach_neg": (lambda x, y, z: C.foreach_neg(x), lambda x, y, z: -x),
    "foreach_sign": (lambda x, y, z: C.foreach_sign(y), lambda x, y, z: torch.sign(y)),
    "foreach_sqrt": (lambda x, y, z: C.foreach_sqrt(x), lambda x, y, z: torch.sqrt(x)),
    "foreach_lerp": (
        lambda x, y, z: C.foreach_lerp(x, y, 0.25),
        lambda x, y, z: torch.lerp(x, y, 0.25),
    ),
    "foreach_addcmul": (
        lambda x, y, z: C.foreach_addcmul(x, y, z, 0.5),
        lambda x, y, z: x + 0.5 * y * z,
    ),
    "foreach_addcmul_": (
        lambda x, y, z: C.foreach_addcmul_(x, y, z, 0.5) or x,
        lambda x, y, z: x + 0.5 * y * z,
    ),
    "foreach_addcdiv_": (
        lambda x, y, z: C.foreach_addcdiv_(x, y, z, 2.0) or x,
        lambda x, y, z: x + 2 * y / z,
    ),
    "foreach_maximum": (
        lambda x, y, z: C.foreach_maximum(x, y),
        lambda x, y, z: torch.maximum(x, y),
    ),
    "foreach_norm": (
        lambda x, y, z: C.foreach_norm(y),
        lambda x, y, z: torch.linalg.vector_norm(y),
    ),
}


def test_the_foreach_cases_cover_every_foreach_shim():
    assert sorted(_FOREACH_CASES) == sorted(n for n in C.__all__ if n.startswith("foreach_"))


@pytest.mark.parametrize("name", sorted(_FOREACH_CASES))
def test_foreach_shim_is_the_torch_op_and_works_on_lists(name):
    # the same object as torch's: Dynamo traces a call through the alias as the original
    assert getattr(C, name) is getattr(torch, "_" + name)
    run, ref = _FOREACH_CASES[name]
    xs, ys, zs = _lists()
    expected = [ref(x, y, z) for x, y, z in zip(*_lists())]
    got = run(xs, ys, zs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_foreach_alias_compiles_fullgraph():
    fn = torch.compile(lambda x, y: C.foreach_add(x, y), backend="eager", fullgraph=True)
    xs, ys, _ = _lists()
    for g, x, y in zip(fn(xs, ys), xs, ys):
        torch.testing.assert_close(g, x + y)


def test_check():
    assert C.check is torch._check
    C.check(True, lambda: "unused")
    with pytest.raises(RuntimeError, match="boom"):
        C.check(False, lambda: "boom")


def test_functorch_introspection_under_vmap_and_grad():
    x = torch.arange(6.0).reshape(2, 3)
    assert not C.is_batchedtensor(x)
    assert not C.is_functorch_wrapped_tensor(x)
    seen = {}

    def f(col):
        seen["batched"] = C.is_batchedtensor(col)
        seen["wrapped"] = C.is_functorch_wrapped_tensor(col)
        seen["bdim"] = C.maybe_get_bdim(col)
        level = C.maybe_get_level(col)
        inner = C.get_unwrapped(col)
        seen["inner"] = tuple(inner.shape)
        again = C.add_batch_dim(inner * 2, C.maybe_get_bdim(col), level)
        seen["again"] = C.is_batchedtensor(again)
        return again

    out = torch.vmap(f, in_dims=1)(x)
    assert seen == {"batched": True, "wrapped": True, "bdim": 1, "inner": (2, 3), "again": True}
    torch.testing.assert_close(out, x.T * 2)

    def g(t):
        seen["grad_wrapped"] = C.is_functorch_wrapped_tensor(t)
        seen["grad_batched"] = C.is_batchedtensor(t)
        seen["grad_inner_wrapped"] = C.is_functorch_wrapped_tensor(C.get_unwrapped(t))
        return t.sum()

    torch.func.grad(g)(x)
    assert seen["grad_wrapped"] is True
    assert seen["grad_batched"] is False
    assert seen["grad_inner_wrapped"] is False


def test_functorch_level_and_unwrapping_one_level():
    x = torch.arange(6.0).reshape(2, 3)
    assert C.functorch_level() == 0
    seen = {}

    def inner(w, t):
        seen["level"] = C.functorch_level()
        seen["grad_unwrapped"] = C.unwrap_for_grad(t, seen["level"])
        seen["other_level"] = C.unwrap_for_grad(t, seen["level"] + 1) is t
        return w.sum()

    torch.func.grad(inner)(torch.ones(()), x)
    assert seen["level"] == 1
    assert seen["grad_unwrapped"] is x
    assert seen["other_level"]

    def col(t):
        level = C.functorch_level()
        base, bdim = C.unwrap_batched(t, level)
        seen["batched"] = (level, base is x, bdim)
        return t

    torch.vmap(col, in_dims=1)(x)
    assert seen["batched"] == (1, True, 1)
    # Dynamo traces all three (one graph, no break)
    from torch._dynamo.testing import CompileCounterWithBackend

    cc = CompileCounterWithBackend("eager")
    f = torch.compile(
        lambda w, t: torch.func.grad(
            lambda w, t: (w * C.unwrap_for_grad(t, C.functorch_level())).sum()
        )(w, t),
        backend=cc,
        fullgraph=True,
    )
    torch.testing.assert_close(f(torch.ones(()), x), x.sum())
    assert cc.frame_count == 1


def test_lazy_clone_and_is_cow():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.ones(3)
    assert C.is_cow(x) is False
    c = C.lazy_clone(x)
    assert C.lazy_clone is torch._lazy_clone
    assert C.is_cow(c) is True  # copy-on-write memory, shared with x until either is written
    assert C.is_cow(x) is True
    c.add_(1)
    assert C.is_cow(c) is False
    assert x.tolist() == [1.0, 1.0, 1.0]
    assert C.is_cow(nn.Parameter(torch.ones(2))) is False
    assert C.is_cow(nn.Parameter(C.lazy_clone(torch.ones(2)))) is True
    with FakeTensorMode():
        fake = torch.ones(2)
        # torch >= 2.14 raises for Python tensor subclasses: the shim answers False
        assert C.is_cow(fake) is False
    assert C.is_cow(fake) is False


def test_is_cow_of_a_memory_mapped_tensor(tmp_path):
    m = tdfunc.MemoryMappedTensor.from_tensor(torch.ones(2), str(tmp_path / "x.bin"))
    assert C.is_cow(m) is False


def test_is_alias_of():
    x = torch.zeros(4)
    assert C.is_alias_of(x[1:], x)
    assert not C.is_alias_of(x.clone(), x)


def test_is_functional_tensor():
    x = torch.ones(2)
    assert C.is_functional_tensor(x) is False
    assert C.is_functional_tensor(torch._to_functional_tensor(x)) is True


def test_disable_torch_function_subclass():
    calls = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    s = torch.ones(2).as_subclass(Logged)
    with C.DisableTorchFunctionSubclass():
        out = torch.add(s, 1)
    assert calls == []
    assert out.tolist() == [2.0, 2.0]
    torch.add(s, 1)
    assert calls


def test_tensor_base_owns_the_c_tensor_methods():
    assert torch.Tensor.size.__objclass__ is C.TensorBase
    assert torch.Tensor.__mro__[1] is C.TensorBase


def test_op_overload_packet():
    assert isinstance(torch.ops.aten.add, C.OpOverloadPacket)
    assert not isinstance(torch.ops.aten.add.Tensor, C.OpOverloadPacket)


def test_make_wrapper_subclass():
    class Wrapper(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    w = C.make_wrapper_subclass(Wrapper, (2, 3), dtype=torch.float16, device="cpu")
    assert type(w) is Wrapper
    assert w.shape == (2, 3)
    assert w.dtype == torch.float16


def test_is_traceable_wrapper_subclass(tmp_path):
    m = tdfunc.MemoryMappedTensor.from_tensor(torch.ones(2), str(tmp_path / "x.bin"))
    assert C.is_traceable_wrapper_subclass(m)
    assert not C.is_traceable_wrapper_subclass(torch.ones(2))
    assert not C.is_traceable_wrapper_subclass(nn.Parameter(torch.ones(2)))


def test_norm_base():
    assert isinstance(nn.BatchNorm1d(3), C.NormBase)
    assert isinstance(nn.InstanceNorm2d(3, track_running_stats=True), C.NormBase)
    assert not isinstance(nn.LayerNorm(3), C.NormBase)


def test_reparametrize_module():
    lin = nn.Linear(2, 1, bias=False)
    own = lin.weight
    w = torch.full((1, 2), 3.0)
    with C.reparametrize_module(lin, {"weight": w}, stack_weights=True):
        assert lin.weight is w
        assert lin(torch.ones(1, 2)).item() == 6.0
    assert lin.weight is own


def test_register_default_collate():
    from torch.utils.data import default_collate
    from torch.utils.data._utils.collate import default_collate_fn_map

    class Thing:
        def __init__(self, v):
            self.v = v

    try:
        assert C.register_default_collate(Thing, lambda batch, **kw: [t.v for t in batch])
        assert default_collate([Thing(1), Thing(2)]) == [1, 2]
    finally:
        default_collate_fn_map.pop(Thing, None)
    # tdfunc's own registration (at import)
    td = tdfunc.TensorDict(a=torch.ones(2))
    assert default_collate([td, td])["a"].shape == (2, 2)


def test_register_ordered_effect():
    @torch.library.custom_op("tdfunc_test_compat::probe", mutates_args=())
    def probe(x: torch.Tensor) -> None:
        return None

    @probe.register_fake
    def _(x: torch.Tensor) -> None:
        return None

    assert C.register_ordered_effect(probe) is True
    # an op without register_effect (older torch): nothing registered, nothing raised
    assert C.register_ordered_effect(object()) is False


def test_control_flow_operators():
    scan_mod = importlib.import_module("torch._higher_order_ops.scan")
    while_mod = importlib.import_module("torch._higher_order_ops.while_loop")
    assert C.torch_scan() is scan_mod.scan
    assert C.torch_while_loop() is while_mod.while_loop


def test_dtensor_classes_are_the_real_ones():
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import _StridedShard

    assert C.DTensorSpec is DTensorSpec
    assert C.TensorMeta is TensorMeta
    assert C.StridedShard is _StridedShard


def test_lazy_shims_are_not_imported_by_import_tdfunc():
    code = """
import sys
import tdfunc
import tdfunc._compat as C
lazy = ("torch._dynamo", "torch.distributed.tensor")
assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]
assert not {"DTensorSpec", "TensorMeta", "StridedShard"} & set(vars(C))
assert C.torch_scan() is sys.modules["torch._higher_order_ops.scan"].scan
assert C.torch_while_loop() is sys.modules["torch._higher_order_ops.while_loop"].while_loop
assert "torch._dynamo" not in sys.modules
from tdfunc._compat import DTensorSpec, StridedShard, TensorMeta
from torch.distributed.tensor._dtensor_spec import DTensorSpec as D, TensorMeta as M
from torch.distributed.tensor.placement_types import _StridedShard as S
assert (DTensorSpec, TensorMeta, StridedShard) == (D, M, S)
assert vars(C)["DTensorSpec"] is D  # cached after the first use
print("LAZY-OK")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "LAZY-OK" in proc.stdout


def test_make_subclass():
    class Sub(torch.Tensor):
        pass

    base = torch.arange(3.0)
    s = C.make_subclass(Sub, base, False)
    assert type(s) is Sub
    assert s.tolist() == [0.0, 1.0, 2.0]
    assert s.data_ptr() == base.data_ptr()  # the same memory, viewed as the subclass
    assert not s.requires_grad


def test_recompute_collectives_patches_the_partitioner_config_while_active():
    import torch._functorch.config as config

    before = config.unsafe_allow_optimization_of_collectives, config.activation_memory_budget
    with C.recompute_collectives():
        assert config.unsafe_allow_optimization_of_collectives is True
        assert config.activation_memory_budget == 0.5
    assert (
        config.unsafe_allow_optimization_of_collectives,
        config.activation_memory_budget,
    ) == before


def test_maybe_mark_dynamic_compiles_one_graph_across_sizes():
    from torch._dynamo.testing import CompileCounterWithBackend

    cnt = CompileCounterWithBackend("eager")
    f = torch.compile(lambda t: t * 2, backend=cnt, fullgraph=True)
    for n in (3, 5, 7):
        t = torch.ones(n)
        C.maybe_mark_dynamic(t, 0)
        assert torch.equal(f(t), t * 2)
    assert cnt.frame_count == 1  # symbolic from the first call
    t = torch.ones(1)
    C.maybe_mark_dynamic(t, 0)  # a size torch specialises: no error, one compile more
    assert torch.equal(f(t), t * 2)
