"""Key-routed actor-critic: one TensorDictSequential run eagerly, compiled and as a vmap ensemble.

Each module reads some entries of a TensorDict and writes its outputs under new keys; the
sequence returns a new TensorDict and never modifies its input.
"""

import torch
from torch import nn

import tdfunc
from tdfunc import from_module, functional_call, stack_modules
from tdfunc.nn import TensorDictModule, TensorDictSequential


def make_policy(obs_dim: int = 4, hidden: int = 32, n_actions: int = 2) -> TensorDictSequential:
    return TensorDictSequential(
        TensorDictModule(
            nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh()), in_keys="obs", out_keys="hidden"
        ),
        TensorDictModule(
            nn.Linear(hidden, n_actions), in_keys="hidden", out_keys=("actor", "logits")
        ),
        TensorDictModule(
            lambda logits: logits.argmax(-1), in_keys=("actor", "logits"), out_keys="action"
        ),
        TensorDictModule(nn.Linear(hidden, 1), in_keys="hidden", out_keys=("critic", "value")),
        selected_out_keys=[("actor", "logits"), "action", ("critic", "value")],  # drop "hidden"
    )


def main() -> None:
    torch.manual_seed(0)
    policy = make_policy()
    print("in_keys:", policy.in_keys, "out_keys:", policy.out_keys)
    batch = tdfunc.TensorDict(
        {"obs": torch.randn(16, 4), "reward": torch.zeros(16)}, batch_size=[16]
    )

    # 1. eager
    out = policy(batch)
    assert "action" in out
    assert "action" not in batch
    assert "hidden" not in out
    print("eager:", out["action"].tolist()[:8], "value shape", tuple(out["critic", "value"].shape))

    # 2. compiled: one graph, no recompile for new values of the same structure
    compiled = torch.compile(policy, fullgraph=True)
    tdfunc.testing.assert_close(compiled(batch), out, rtol=1e-4, atol=1e-5)
    fresh = batch.set("obs", torch.randn(16, 4))
    tdfunc.testing.assert_close(compiled(fresh), policy(fresh), rtol=1e-4, atol=1e-5)
    print("compiled: matches eager")

    # 3. a vmap ensemble of 5 independently initialised policies
    members = [make_policy() for _ in range(5)]
    params = stack_modules(members)  # a TensorDict with batch_size [5]

    def run(p: tdfunc.TensorDict, td: tdfunc.TensorDict) -> tdfunc.TensorDict:
        return functional_call(members[0], p, (td,))

    ensemble = torch.vmap(run, in_dims=(0, None))
    values = ensemble(params, batch)
    assert values.batch_size == (5, 16)
    for i, member in enumerate(members):
        tdfunc.testing.assert_close(values[i], member(batch), rtol=1e-5, atol=1e-6)
    spread = values["critic", "value"].std(0).mean()
    print(
        f"ensemble: batch_size {tuple(values.batch_size)}, value spread across members {spread:.3f}"
    )
    n_params = sum(p.numel() for p in from_module(policy).leaves())
    print("parameters per member:", n_params)


if __name__ == "__main__":
    main()
