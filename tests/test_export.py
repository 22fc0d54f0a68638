"""torch.export of modules taking and returning TensorDicts / tensorclasses: dynamic batch dims,
save / load round trips (weights_only loading), runs at other batch sizes, control flow inside."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from torch import nn
from torch.export import Dim

from tdfunc import TensorDict, cond, tensorclass
from tdfunc._errors import NOT_A_BATCH_DIM
from tdfunc._export import dynamic_batch_shapes
from tdfunc.testing import assert_close


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, td: TensorDict) -> TensorDict:
        h = torch.tanh(self.enc(td["obs"]))
        return td.set("hidden", h).set(("out", "action"), self.head(h) + td["state", "bias"])


def make_td(b: int) -> TensorDict:
    return TensorDict(
        {"obs": torch.randn(b, 3), "state": {"bias": torch.randn(b, 2), "t": torch.arange(b)}},
        batch_size=[b],
    )


def round_trip(ep: torch.export.ExportedProgram, caplog) -> torch.export.ExportedProgram:
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    with caplog.at_level(logging.WARNING):
        loaded = torch.export.load(buf)
    # torch falls back to weights_only=False (and logs it) when a type is not allow-listed
    assert "Fallback to weights_only=False" not in caplog.text
    return loaded


def test_dynamic_batch_shapes_spec():
    td = make_td(4)
    b = Dim("b")
    assert dynamic_batch_shapes((td, torch.zeros(2)), b) == ([{0: b}, {0: b}, {0: b}], None)
    assert dynamic_batch_shapes(td) == [{0: Dim.DYNAMIC}] * 3  # one entry per leaf
    two = TensorDict({"x": torch.randn(2, 3, 4)}, batch_size=[2, 3])
    assert dynamic_batch_shapes({"t": two}, {0: b, 1: Dim.AUTO}) == {"t": [{0: b, 1: Dim.AUTO}]}
    expected = NOT_A_BATCH_DIM.format(dim=1, cls="TensorDict", path="[0]", batch_size=(4,))
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        dynamic_batch_shapes([td], {1: b})


def test_export_tensordict_dynamic_batch_save_load_other_batch_sizes(caplog):
    model = Policy()
    td = make_td(4)
    ep = torch.export.export(model, (td,), dynamic_shapes=dynamic_batch_shapes((td,), Dim("b")))
    for b in (7, 2):
        other = make_td(b)
        out = ep.module()(other)
        assert isinstance(out, TensorDict)
        assert out.batch_size == (b,)
        assert out["out"].batch_size == (b,)
        assert_close(out, model(other))
        assert "hidden" not in other  # the input is not changed
    loaded = round_trip(ep, caplog)
    other = make_td(11)
    assert_close(loaded.module()(other), model(other))


def test_export_without_dynamic_shapes_is_specialised():
    model = Policy()
    ep = torch.export.export(model, (make_td(4),))
    td = make_td(4)
    assert_close(ep.module()(td), model(td))
    # the exported program checks its input shapes: batch size 4 only
    with pytest.raises(AssertionError, match=r"Guard failed: .*\.size\(\)\[0\] == 4"):
        ep.module()(make_td(5))


if tensorclass is not None:
    # module level: saving an exported program pickles its example inputs by reference

    @tensorclass
    class Obs:
        pixels: torch.Tensor
        mask: torch.Tensor
        pred: torch.Tensor | None = None
        scale: float = 2.0


def test_export_tensorclass_in_and_out(caplog):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, o: Obs) -> Obs:
            return o.replace(pred=self.lin(o.pixels * o.scale) * o.mask[..., None])

    model = M()

    def make(b: int) -> Obs:
        return Obs(torch.randn(b, 4), (torch.rand(b) > 0.5).float(), batch_size=[b])

    o = make(5)
    ep = torch.export.export(model, (o,), dynamic_shapes=dynamic_batch_shapes((o,)))
    other = make(9)
    out = ep.module()(other)
    assert type(out) is Obs
    assert out.batch_size == (9,)
    assert out.scale == 2.0
    assert_close(out, model(other))
    loaded = round_trip(ep, caplog)
    out2 = loaded.module()(make(3))
    assert type(out2) is Obs
    assert out2.pred.shape == (3, 3)


def test_export_with_tdfunc_cond_inside():
    class Gate(nn.Module):
        def forward(self, td: TensorDict) -> TensorDict:
            return cond(
                td["x"].sum() > 0,
                lambda t: t.set("y", t["x"] * 2),
                lambda t: t.set("y", t["x"] - 1),
                (td,),
            )

    td = TensorDict({"x": torch.ones(4, 2)}, batch_size=[4])
    ep = torch.export.export(Gate(), (td,), dynamic_shapes=dynamic_batch_shapes((td,)))
    for x in (torch.ones(6, 2), -torch.ones(3, 2)):
        t = TensorDict({"x": x}, batch_size=[x.shape[0]])
        assert_close(ep.module()(t), Gate()(t))
