"""What users read, run: the README (its benchmark table is the one the report writes from
``compile_benchmarks/RESULTS.md``, its example runs, it names no development machine) and the
value-model, storage and migration statements of the guides (``docs/guides``): what
immutability covers (the container, not its tensors), state dicts, and every row of the table
"Migrating from tensordict"."""

from __future__ import annotations

import importlib.util
import re
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import tdfunc
from tdfunc import MemoryMappedTensor, TensorDict, tensorclass
from tdfunc.nn import TensorDictModule as Mod
from tdfunc.nn import TensorDictSequential as Seq

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _wheel_check():
    """``.ci/wheel_check.py``: the one place that reads the README's example."""
    spec = importlib.util.spec_from_file_location(
        "tdfunc_wheel_check", ROOT / ".ci" / "wheel_check.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------ README
def test_readme_benchmark_table_is_the_one_the_report_writes():
    from compile_benchmarks import report

    want = report.headline(report.RESULTS_MD.read_text(encoding="utf-8"))
    text = README.read_text(encoding="utf-8")
    start, end = report.readme_block(text)
    assert text[start:end] == want, (
        "README.md's benchmark table differs from compile_benchmarks/RESULTS.md: run "
        "python -m compile_benchmarks.report --readme"
    )


def _report_text(mlp_ratio: float, quick: bool = False) -> str:
    """A RESULTS.md written by the report from one compiled MLP-step row (tdfunc and torch.func
    at ``mlp_ratio``, 3 passes) and one graph-break count."""
    from compile_benchmarks import report

    def entry(seconds: float, **info) -> report.Entry:
        times = {p: seconds * (1 + p / 10) for p in range(3)}
        return report.Entry(medians=times, rounds=3, info={"backend": "inductor", **info})

    rows = {
        ("workloads", "train_step_mlp", "compiled"): {
            "tdfunc": entry(mlp_ratio * 1e-3, graphs=1, graph_breaks=0, recompiles=0),
            "torch_func": entry(1e-3),
        }
    }
    meta = {
        "date": "2031-01-02T03:04:05+00:00",
        "cpu": "Some CPU",
        "cores": 8,
        "torch_threads": 1,
        "versions": {"torch": "9.9.9"},
        "timer": "time.process_time",
        "passes": 3,
        "quick": quick,
    }
    return report.render(report.Results(rows, meta, {}, {}))


def test_headline_reads_the_ratios_and_run_of_the_report():
    from compile_benchmarks import report

    block = report.headline(_report_text(1.5))
    assert block.startswith(report.HEADLINE_START + "\n")
    assert block.endswith("\n" + report.HEADLINE_END)
    assert "`make bench` of 2031-01-02: torch 9.9.9, Some CPU, 8 cores" in block
    assert (
        "| compiled MLP training step | `torch.func` on a flat dict | 1.50x | ≤ 1.05x ✗ |" in block
    )
    assert "| graph breaks, every compiled tdfunc workload (1) | — | 0 | 0 ✓ |" in block
    assert "replay" not in block  # rows the report did not measure are left out
    met = report.headline(_report_text(0.8))
    assert "| 0.80x | ≤ 1.05x ✓ |" in met
    # a stale README table is replaced, the text around it kept
    readme = f"# x\n\n{block}\n\nafter\n"
    assert report.with_headline(readme, met) == f"# x\n\n{met}\n\nafter\n"


def test_headline_refuses_a_quick_run_and_a_readme_without_markers(tmp_path):
    from compile_benchmarks import report

    with pytest.raises(ValueError, match=r"RESULTS\.md is a quick smoke run .* run `make bench`"):
        report.headline(_report_text(1.0, quick=True), tmp_path / "RESULTS.md")
    with pytest.raises(ValueError, match=r"RESULTS\.md: no '## Machine and versions' table"):
        report.headline("# nothing\n", tmp_path / "RESULTS.md")
    with pytest.raises(ValueError, match=r"README\.md: no benchmark table between"):
        report.with_headline("# x\nno table\n", "", tmp_path / "README.md")
    readme = tmp_path / "README.md"
    results = tmp_path / "RESULTS.md"
    results.write_text(_report_text(1.5), encoding="utf-8")
    readme.write_text(f"top\n{report.HEADLINE_START}\nold\n{report.HEADLINE_END}\n", "utf-8")
    assert report.write_headline(readme, results) is True
    assert "1.50x" in readme.read_text(encoding="utf-8")
    assert report.write_headline(readme, results) is False


def test_readme_example_runs_as_written():
    # the README's own text (CI also runs it from the built wheel, with inductor): the training
    # step and the ensemble step compile once each (one graph, no recompile over 200 steps)
    from torch._dynamo.testing import CompileCounterWithBackend

    code = _wheel_check().readme_example(README.read_text(encoding="utf-8"))
    counter = CompileCounterWithBackend("aot_eager")
    compile_ = torch.compile

    def counted(fn, **kwargs):
        return compile_(fn, backend=counter, **kwargs)

    ns: dict = {}
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", counted)
        exec(compile(code, str(README), "exec"), ns)
    assert counter.frame_count == 2
    assert float(ns["loss"]) < 0.05
    assert ns["members"].batch_size == (4,)
    assert ns["losses"].shape == (4,)
    assert float(ns["losses"].max()) < 0.05
    # trained on new tensors: the module's own weights were never written
    assert not torch.equal(ns["params"]["0", "weight"], ns["model"][0].weight)


def test_readme_example_is_found_or_named_missing(tmp_path):
    wc = _wheel_check()
    text = "# t\n## Install\n```python\nno = 1\n```\n## Example\n\n```python\nyes = 1\n```\n"
    assert wc.readme_example(text) == "yes = 1\n"
    with pytest.raises(ValueError, match=r"README\.md: no ```python block under a '## Example'"):
        wc.readme_example(
            "# t\n## Example\ntext\n## Next\n```python\nx = 1\n```\n", tmp_path / "README.md"
        )


def test_readme_is_short_keeps_the_ci_commands_and_names_no_machine():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 110
    commands = re.findall(r"^make (\w+)", text, re.MULTILINE)
    assert "demo" in commands
    assert "test" in commands
    for phrase in ("this machine", "on this machine", "pip's configuration", "constraint"):
        assert phrase not in text.lower(), phrase
    for link in re.findall(r"\]\(([^)#:]+)", text):
        assert (ROOT / link).exists(), link


def test_wheel_problems_name_what_is_missing(tmp_path):
    wc = _wheel_check()
    wheel = tmp_path / "tdfunc-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tdfunc/__init__.py", "")
        z.writestr("tests/test_x.py", "")
        z.writestr(
            "tdfunc-0.dist-info/METADATA",
            'Name: tdfunc\nRequires-Dist: torch<3,>=2.13\nRequires-Dist: tqdm; extra == "progress"\n',
        )
    assert wc.wheel_problems(wheel, {"torch", "optree"}) == [
        "tdfunc/py.typed is not in the wheel",
        "files outside the package: ['tests']",
        "Requires-Dist ['torch'] != dependencies ['optree', 'torch']",
    ]
    assert wc.declared()[0] == {"torch", "optree", "numpy"}
    assert wc.pinned_torch().startswith("torch==")


def _td() -> TensorDict:
    return TensorDict(a=torch.zeros(3, 2), n={"b": torch.ones(3)}, batch_size=[3])


# ------------------------------------------------------------------------ what immutable means
def test_changing_the_container_raises_type_error_naming_the_functional_form():
    td = _td()
    with pytest.raises(TypeError, match=r"td.set\('a', value\)"):
        td["a"] = torch.ones(3, 2)
    with pytest.raises(TypeError, match=r"td.exclude\('a'\)"):
        del td["a"]
    with pytest.raises(TypeError, match="replace"):
        td.x = 1  # type: ignore[attr-defined]
    assert td.keys() == ["a", "n"]


def test_the_tensors_are_shared_not_protected():
    td = _td()
    td2 = td.set("c", torch.ones(3))  # a new container sharing every leaf it did not compute
    assert td2["a"] is td["a"]
    assert td2["n", "b"] is td["n", "b"]
    td["a"].add_(1)  # a tensor method that writes in place still writes
    assert td2["a"].tolist() == [[1.0, 1.0]] * 3
    own = td.clone()  # tensors of its own
    td["a"].add_(1)
    assert own["a"].tolist() == [[1.0, 1.0]] * 3
    assert td["a"].tolist() == [[2.0, 2.0]] * 3


def test_from_module_shares_the_module_tensors():
    m = nn.Linear(2, 1)
    params = tdfunc.from_module(m)
    assert params["weight"].untyped_storage().data_ptr() == m.weight.untyped_storage().data_ptr()


def test_read_only_store_leaves_refuse_writes(tmp_path):
    tdfunc.save(_td(), tmp_path / "s")
    td = tdfunc.load(tmp_path / "s")
    with pytest.raises(PermissionError):
        td["a"].add_(1)
    with pytest.raises(PermissionError):
        td["n", "b"][0] = 5.0
    assert float(td["a"].sum()) == 0.0


def test_state_dict_hand_off_and_len_iter_follow_the_batch():
    td = _td()
    sd = td.to_state_dict()
    assert list(sd) == ["a", "n.b"]
    assert sd["a"] is td["a"]
    assert len(td) == 3
    assert [row.batch_size for row in td] == [torch.Size([])] * 3


# ------------------------------------------------------------------------ storage section
def test_leaf_attributes_and_modes(tmp_path):
    tdfunc.save(_td(), tmp_path / "s")
    for mode in ("r", "r+", "c"):
        leaf = tdfunc.load(tmp_path / "s", mode=mode)["a"]
        assert isinstance(leaf, MemoryMappedTensor)
        assert leaf.mode == mode
        assert leaf.filename == str(tmp_path / "s" / "data.bin")


# ------------------------------------------------------------------------ migration table
def test_row_set_and_update():
    td = _td()
    x = torch.full((3,), 7.0)
    td2 = td.set("a", x)
    assert td2["a"] is x
    assert td["a"].shape == (3, 2)  # the old value is unchanged
    td3 = td.update({"c": x, "d": x})
    assert td3.keys() == ["a", "n", "c", "d"]


def test_row_in_place_copy_still_writes_into_the_tensor():
    td = _td()
    other = td.select("a")
    td["a"].copy_(torch.ones(3, 2))
    assert other["a"].tolist() == [[1.0, 1.0]] * 3


def test_row_pop():
    td = _td()
    x, rest = td.popped("a")  # pure: the value and the container without it
    assert x.shape == (3, 2)
    assert rest.keys() == ["n"]
    assert td.keys() == ["a", "n"]
    assert td.exclude("a").keys() == ["n"]


@tensorclass
class Rec:
    x: torch.Tensor
    y: torch.Tensor


def test_row_tensorclass_replace():
    tc = Rec(torch.zeros(2), torch.ones(2), batch_size=[2])
    tc2 = tc.replace(x=torch.full((2,), 3.0))
    assert tc2.x.tolist() == [3.0, 3.0]
    assert tc.x.tolist() == [0.0, 0.0]
    with pytest.raises(AttributeError, match=r"replace\(x=\.\.\.\)"):  # FrozenInstanceError
        tc.x = torch.ones(2)


def test_row_functional_call():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    params = tdfunc.from_module(model).apply(torch.zeros_like)
    x = torch.randn(4, 3)
    out = tdfunc.functional_call(model, params, (x,))
    assert out.tolist() == [[0.0, 0.0]] * 4
    assert model.weight.abs().sum() > 0  # the module's own tensors are untouched


def test_row_from_module_and_load_state_dict():
    src, dst = nn.Linear(3, 2), nn.Linear(3, 2)
    params = tdfunc.from_module(src)
    dst.load_state_dict(params.to_state_dict())
    torch.testing.assert_close(dst.weight, src.weight)
    dst2 = nn.Linear(3, 2)
    dst2.load_state_dict(dict(params.flatten_keys().items()))  # the longer form still works
    torch.testing.assert_close(dst2.bias, src.bias)
    # tied weights: one leaf per tie in the container, every name in tdfunc.state_dict
    lin = nn.Linear(2, 2)
    tied = nn.Sequential(lin, lin)
    params = tdfunc.from_module(tied) * 0
    assert sorted(params.to_state_dict()) == ["0.bias", "0.weight"]
    result = tied.load_state_dict(tdfunc.state_dict(tied, params))
    assert result.missing_keys == []
    assert lin.weight.abs().sum() == 0


def test_row_modules_return_the_outputs():
    td = TensorDict(obs=torch.randn(5, 4), batch_size=[5])
    mod = Mod(nn.Linear(4, 2), in_keys="obs", out_keys="logits")
    out = mod(td)
    assert out.keys() == ["obs", "logits"]
    assert td.keys() == ["obs"]  # the input is not written


def test_row_keyword_tensors():
    mod = Mod(lambda x, y: x + y, in_keys={"x": "a", "y": "b"}, out_keys="c")
    got = mod(a=torch.ones(2), b=torch.ones(2))  # keywords named after the in keys
    assert got.tolist() == [2.0, 2.0]


def test_row_plain_callable_in_a_sequential():
    seq = Seq(
        Mod(lambda x: x * 2, in_keys="a", out_keys="b"),
        lambda td: td.set("c", td["b"] + 1),
    )
    out = seq(TensorDict(a=torch.ones(2), batch_size=[2]))
    assert out["c"].tolist() == [3.0, 3.0]


def test_row_nested_tuple_keys_are_flattened():
    mod = Mod(lambda x: x + 1, in_keys=[(("a",), "b")], out_keys=[(("c",), "d")])
    out = mod(TensorDict(a={"b": torch.zeros(2)}, batch_size=[2]))
    assert out["c", "d"].tolist() == [1.0, 1.0]


def test_row_memmap_save_load(tmp_path):
    td = _td()
    tdfunc.save(td, tmp_path / "s")
    tdfunc.testing.assert_close(tdfunc.load(tmp_path / "s"), td)


def test_row_safetensors(tmp_path):
    td = _td()
    tdfunc.save_safetensors(td, tmp_path / "m.safetensors")
    tdfunc.testing.assert_close(tdfunc.load_safetensors(tmp_path / "m.safetensors"), td)


def test_row_from_tensordict_shares_or_copies(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    src = tensordict.TensorDict(a=torch.zeros(3, 2), n={"b": torch.ones(3)}, batch_size=[3])
    shared = tdfunc.from_tensordict(src)
    copied = tdfunc.from_tensordict(src, copy=True)
    assert shared["a"] is src["a"]
    assert copied["a"] is not src["a"]
    src["a"].add_(1)  # tensordict-era in-place code
    src["n"]["b"].mul_(5)
    assert shared["a"].tolist() == [[1.0, 1.0]] * 3  # the shared value changed
    assert copied["a"].tolist() == [[0.0, 0.0]] * 3  # the copy did not
    assert copied["n", "b"].tolist() == [1.0] * 3
    assert copied.batch_size == (3,)
    # memory-mapped tensordict leaves are copied into memory
    mm = src.memmap(tmp_path / "ttd")
    back = tdfunc.from_tensordict(mm, copy=True)
    assert type(back["a"]) is torch.Tensor
    torch.testing.assert_close(back["a"], torch.ones(3, 2))
    assert tdfunc.to_tensordict(shared)["a"] is shared["a"]
