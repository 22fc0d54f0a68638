"""One shared corpus of containers and ops, run eagerly and compiled (differential testing).

Containers are factories (new random values each call, same structure). Each op is a function of
one container; ``FLOAT_ONLY`` ops need floating leaves, ``NEEDS_KEYS`` ops use the keys of the
nested corpus container.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import tdfunc
from tdfunc import TensorDict


def nested() -> TensorDict:
    """batch [4, 3]; a nested TensorDict with an extra batch dim; mixed leaf ndims."""
    return TensorDict(
        {
            "a": torch.randn(4, 3, 2),
            "b": TensorDict(
                {"c": torch.randn(4, 3, 2), "d": torch.randn(4, 3, 2, 5)}, batch_size=[4, 3, 2]
            ),
            "e": torch.randn(4, 3),
        },
        batch_size=[4, 3],
    )


def flat_mixed() -> TensorDict:
    """batch [4]; float32, float64 and int64 leaves."""
    return TensorDict(
        {
            "x": torch.randn(4, 2),
            "y": torch.randn(4, dtype=torch.float64),
            "i": torch.randint(0, 10, (4, 3)),
        },
        batch_size=[4],
    )


def empty() -> TensorDict:
    """No leaves, batch [4, 3]."""
    return TensorDict(batch_size=[4, 3])


CONTAINERS: dict[str, Callable[[], Any]] = {
    "nested": nested,
    "flat_mixed": flat_mixed,
    "empty": empty,
}

# ops valid on any container with batch dims >= 1 and first batch dim 4
OPS: dict[str, Callable[[Any], Any]] = {
    "add_scalar": lambda t: t + 1,
    "add_self": lambda t: t + t,
    "radd_tensor": lambda t: torch.tensor(2) + t,
    "rmul_tensor": lambda t: torch.full((), 3) * t,
    "mul_tensor": lambda t: t * torch.ones((), dtype=torch.int64),
    "rsub_number": lambda t: 1 - t,
    "pow": lambda t: t**2,
    "neg": lambda t: -t,
    "abs": lambda t: abs(t),
    "eq": lambda t: t == t,
    "lt": lambda t: t < 1,
    "index_int": lambda t: t[0],
    "index_neg": lambda t: t[-1],
    "index_slice": lambda t: t[1:3],
    "index_none_ellipsis": lambda t: t[None, ..., None],
    "index_tensor": lambda t: t[torch.tensor([0, 2])],
    "index_list": lambda t: t[[3, 1]],
    "index_mask": lambda t: t[torch.tensor([True, False, True, True])],
    "at_set": lambda t: t.at[1:3].set(0),
    "at_add": lambda t: t.at[0].add(1),
    "reshape": lambda t: t.reshape(-1),
    "view": lambda t: t.view(t.numel()),
    "unsqueeze_squeeze": lambda t: t.unsqueeze(0).squeeze(0),
    "unsqueeze": lambda t: t.unsqueeze(-1),
    "flatten": lambda t: t.flatten(),
    "unflatten": lambda t: t.unflatten(0, (2, 2)),
    "expand": lambda t: t.expand(2, *t.batch_size),
    "stack": lambda t: tdfunc.stack([t, t], 0),
    "torch_stack": lambda t: torch.stack([t, t], 1),
    "cat": lambda t: tdfunc.cat([t, t]),
    "torch_cat": lambda t: torch.cat([t, t[:1]]),
    "unbind": lambda t: t.unbind(0),
    "torch_unbind": lambda t: torch.unbind(t, 0),
    "split": lambda t: t.split([1, 3]),
    "chunk": lambda t: t.chunk(2),
    "apply": lambda t: t.apply(lambda x: x * 2),
    "apply_others": lambda t: t.apply(torch.add, t),
    "named_apply": lambda t: t.named_apply(lambda p, x: x + len(p)),
    "to_dtype": lambda t: t.to(torch.float64),
    "to_device": lambda t: t.to("cpu"),
    "clone": lambda t: t.clone(),
    "detach": lambda t: t.detach(),
    "contiguous": lambda t: t.contiguous(),
    "zeros_like": lambda t: tdfunc.zeros_like(t),
    "torch_ones_like": lambda t: torch.ones_like(t),
    "full_like": lambda t: tdfunc.full_like(t, 3),
    "consolidate": lambda t: t.consolidate(),
    "sum_all": lambda t: t.sum(),
    "sum_dim": lambda t: t.sum(dim=0),
    "prod_dim": lambda t: t.prod(dim=0),
    "amax": lambda t: t.amax(0),
    "amin_keepdim": lambda t: t.amin(0, keepdim=True),
    "all": lambda t: (t > -100).all(),
    "any": lambda t: (t > 100).any(),
    "all_dim": lambda t: (t > 0).all(dim=0),
    "len_numel": lambda t: tdfunc.full_like(t, len(t) + t.numel()),
    "iterate": lambda t: list(t),
    "to_dict": lambda t: t.to_dict() if isinstance(t, TensorDict) else t,
}

FLOAT_ONLY: dict[str, Callable[[Any], Any]] = {
    "div": lambda t: t / 2,
    "mean": lambda t: t.mean(dim=0),
    "std": lambda t: t.std(0),
    "var_all": lambda t: t.var(),
    "torch_tanh": lambda t: torch.tanh(t),
}

KEYED: dict[str, dict[str, Callable[[Any], Any]]] = {
    "nested": {
        "getitem": lambda t: t["a"] + 1,
        "nested_get": lambda t: t["b", "c"] * 2,
        "get_default": lambda t: t.get(("b", "zz"), t["e"]),
        "contains": lambda t: t["e"] + (1 if ("b", "d") in t else 0),
        "keys_values": lambda t: sum(v.sum() for v in t.values(True, True)),
        "items": lambda t: [k for k, _ in t.items(True)],
        "set": lambda t: t.set("x", t["a"] * 2),
        "set_nested_new": lambda t: t.set(("y", "z"), t["e"] + 1),
        "update": lambda t: t.update({"e": t["e"] + 1, "b": {"c": t["b", "c"] * 0}}),
        "replace": lambda t: t.replace(e=t["e"] * 0),
        "replace_chain": lambda t: _replace_chain(t),
        "select": lambda t: t.select("a", ("b", "c")),
        "exclude": lambda t: t.exclude("a", ("b", "d")),
        "rename_key": lambda t: t.rename_key("a", "z"),
        "flatten_keys": lambda t: t.flatten_keys(),
        "unflatten_keys": lambda t: t.flatten_keys().unflatten_keys(),
        "permute": lambda t: t.permute(1, 0),
        "transpose": lambda t: t.transpose(0, -1),
        "construct": lambda t: TensorDict({"q": t["a"] * 1, "r": {"s": t["e"]}}, batch_size=[4, 3]),
        "from_dict": lambda t: TensorDict.from_dict({"q": t["a"] + 0}, batch_dims=2),
        "bool_mask_2d": lambda t: t[t["e"] > 0],
    },
}


def _replace_chain(t: TensorDict) -> TensorDict:
    for i in range(10):
        t = t.replace(e=t["e"] + i)
    return t
