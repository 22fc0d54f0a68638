"""Variable-length batches: jagged leaves against padding + a mask, paired rounds.

The batch: 64 sequences of 16 to 512 steps (uniform, seeded), 64 features, float32. The step:
a pointwise op over every value (``exp(2 x + 1)``), then the mean over time of each sequence.

* ``ragged_step`` (eager and compiled, ``fullgraph=True``): tdfunc with the sequences as one
  jagged leaf (``torch.nested``, ``layout=torch.jagged``: only the data, ``y["x"].mean(1)``
  over the ragged dim) against tdfunc with them padded to 512 steps and a ``[64, 512]`` mask
  (the pointwise op runs on the padding too; masked mean ``(y * m).sum(1) / m.sum(1)``).
* ``ragged_collate_step`` (eager): from the 64 samples as containers to the means: tdfunc
  ``as_jagged`` + the jagged step against tensordict's ``pad_sequence(..., return_mask=True)``
  + the masked step on the tensordict batch (tensordict's route for variable-length data).

Recorded beside the ratios: the bytes each batch holds (``jagged_bytes``, ``padded_bytes``).
Ratio = jagged / other (below 1: jagged is faster), median of paired rounds with the A/A
control (``compile_benchmarks/paired.py``); one thread. Quick mode: 8 sequences, the
Dynamo-only backend (its ratios are not measurements).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tdfunc
from compile_benchmarks.paired import report

CATEGORY = "ragged"
FEAT = 64


def _lengths(n: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(16, 513, (n,), generator=g).tolist()


def _samples(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(t, FEAT, generator=g) for t in _lengths(n)]


def _jagged(seqs: list[torch.Tensor]) -> Any:
    x = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    return tdfunc.TensorDict(x=x, batch_size=[len(seqs)])


def _padded(seqs: list[torch.Tensor]) -> Any:
    x = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    lens = torch.tensor([len(s) for s in seqs])
    mask = torch.arange(x.shape[1]) < lens.unsqueeze(1)
    return tdfunc.TensorDict(x=x, mask=mask, batch_size=[len(seqs)])


def jagged_step(td: Any) -> torch.Tensor:
    y = (td * 2.0 + 1.0).exp()
    return y["x"].mean(1)


def padded_step(td: Any) -> torch.Tensor:
    m = td["mask"]
    y = (td.exclude("mask") * 2.0 + 1.0).exp()
    return (y["x"] * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True)


def _bytes(td: Any) -> int:
    total = 0
    for x in td.values():
        if x.is_nested:
            total += x.values().nbytes + x.offsets().nbytes
        else:
            total += x.nbytes
    return total


def test_ragged_step(benchmark: Any, bench_quick: bool, mode: str) -> None:
    """See the module docstring: jagged / padded + mask, eager or compiled."""
    torch.set_num_threads(1)
    seqs = _samples(8 if bench_quick else 64)
    jag, pad = _jagged(seqs), _padded(seqs)
    a, b = jagged_step, padded_step
    a2 = lambda t: jagged_step(t)  # noqa: E731 (its own code object: its own compiled copy)
    if mode == "compiled":
        backend = "eager" if bench_quick else "inductor"
        a = torch.compile(a, backend=backend, fullgraph=True)
        a2 = torch.compile(a2, backend=backend, fullgraph=True)
        b = torch.compile(b, backend=backend, fullgraph=True)
    torch.testing.assert_close(a(jag), b(pad), rtol=1e-4, atol=1e-4)
    rounds, calls = (3, 2) if bench_quick else (11, 10)
    report(
        benchmark,
        category=CATEGORY,
        workload="ragged_step",
        mode=mode,
        against="padded_mask",
        a=lambda: a(jag),
        a2=lambda: a2(jag),
        b=lambda: b(pad),
        rounds=rounds,
        calls=calls,
        extra={"jagged_bytes": _bytes(jag), "padded_bytes": _bytes(pad)},
    )


@pytest.mark.parametrize("mode", ["eager"])
def test_ragged_collate_step(benchmark: Any, bench_quick: bool, mode: str) -> None:
    """See the module docstring: as_jagged + step / tensordict's pad_sequence + masked step."""
    tensordict = pytest.importorskip("tensordict", reason="tensordict is not installed")
    torch.set_num_threads(1)
    seqs = _samples(8 if bench_quick else 64)
    ours = [tdfunc.TensorDict(x=s) for s in seqs]
    theirs = [tensordict.TensorDict(x=s) for s in seqs]

    def tdfunc_route() -> torch.Tensor:
        return jagged_step(tdfunc.as_jagged(ours))

    def tensordict_route() -> torch.Tensor:
        batch = tensordict.pad_sequence(theirs, return_mask=True)
        m = batch["masks", "x"]
        y = (batch.exclude("masks") * 2.0 + 1.0).exp()
        return (y["x"] * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True)

    torch.testing.assert_close(tdfunc_route(), tensordict_route(), rtol=1e-4, atol=1e-4)
    rounds, calls = (3, 2) if bench_quick else (11, 5)
    report(
        benchmark,
        category=CATEGORY,
        workload="ragged_collate_step",
        mode=mode,
        against="tensordict_pad_sequence",
        a=tdfunc_route,
        a2=lambda: jagged_step(tdfunc.as_jagged(ours)),
        b=tensordict_route,
        rounds=rounds,
        calls=calls,
        extra={
            "jagged_bytes": _bytes(tdfunc.as_jagged(ours)),
            "padded_bytes": _bytes(_padded(seqs)),
        },
    )
