"""Rank functions of the tdfunc.optim tests (spawned by ``tdfunc.testing.launch``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import tdfunc
from tdfunc import optim


def sharded_clip_adamw(rank: int, world: int) -> dict[str, Any]:
    """3 steps of clip_by_global_norm + AdamW on an MLP sharded over the ranks (``Shard(0)``,
    uneven shards included) and on the same MLP unsharded: the full tensors must agree."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    params = tdfunc.from_module(net).detach().clone()
    mesh = init_device_mesh("cpu", (world,))
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=0.1))
    plain, dist = params, params.apply(shard)
    s_plain, s_dist = opt.init(plain), opt.init(dist)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        grads = params.apply(lambda p, g=g: torch.randn(p.shape, generator=g) * 3)
        u, s_plain = opt.update(grads, s_plain, plain)
        plain = optim.apply_updates(plain, u)
        u, s_dist = opt.update(grads.apply(shard), s_dist, dist)
        dist = optim.apply_updates(dist, u)
    return {
        "plain": plain.to_dict(),
        "dist": dist.apply(lambda t: t.full_tensor()).to_dict(),
        "local_rows": int(dist["0", "bias"].to_local().shape[0]),
    }
