"""Probabilistic key-routed modules: ``ProbabilisticTensorDictModule`` builds a
``torch.distributions`` distribution from entries of a container and writes a value drawn
from it (its mode, mean, a sample...); ``ProbabilisticTensorDictSequential`` computes the
parameters with key-routed modules first. The names, arguments and keys follow
``tensordict.nn`` (0.15), and both are pure as :class:`~tdfunc.nn.TensorDictModule` is: the
result is a new container, the input is never written, nothing is cached between calls.

How the value is chosen is fixed when the module is built (``default_interaction_type``), or
in a new module (:meth:`ProbabilisticTensorDictModule.with_interaction_type`): there is no
global interaction-type context to read, so a compiled program sees one plain path.

Random values come from torch's global generator (``rsample`` / ``sample``), which traces
under ``torch.compile(fullgraph=True)``. For values that repeat, a ``torch.Generator`` (eager
only: Dynamo in torch 2.13 refuses a generator argument, "Failed to convert args/kwargs to
proxy"), or uniform noise read from the input at ``uniform_key``: one code path for both,
inverse-transform sampling (``icdf`` of the distribution, the inverse CDF of a categorical or
Bernoulli), which compiles, vmaps and keeps ``rsample``'s gradients (``loc + scale * z``
for a normal).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributions as D
from torch import Tensor, nn

from .._keys import fmt_key
from .._tree import KeyPath, Node
from ._modules import TensorDictSequential, _keyword_call
from ._routing import (
    BAD_KWARG,
    NO_INPUT,
    NOT_A_CONTAINER,
    Key,
    apply_plan,
    check_out_paths,
    kwarg_name,
    make_plan,
    public_key,
    read_key,
    to_path,
    to_paths,
)

# ---------------------------------------------------------------------------------- messages
BAD_INTERACTION = (
    "default_interaction_type must be one of {names} (or tensordict's InteractionType), got {got!r}"
)
ONE_OUT_KEY = (
    "ProbabilisticTensorDictModule writes one sample key, got out_keys {out_keys} (a "
    "CompositeDistribution over several keys is not supported)"
)
NO_OUT_KEY = "ProbabilisticTensorDictModule needs out_keys: the key the value is written to"
LOG_PROB_KEYS = (
    "log_prob_keys names one key per sampled key: one here, got {got}; or pass log_prob_key"
)
NOT_CALLABLE_DIST = (
    "distribution_class must be a torch.distributions.Distribution class or a callable that "
    "builds one from the parameters as keywords, got {typ}"
)
NOT_A_DISTRIBUTION = "{module}: distribution_class returned a {typ}, not a torch distribution"
BAD_GENERATOR = (
    "generator must be a torch.Generator, an int seed or None, got {typ}; a key of the input "
    "(tensordict's generator=key) would be written back: pass uniform noise at uniform_key "
    "instead"
)
BOTH_SOURCES = "pass generator or uniform_key, not both"
UNIFORM_SHAPE = (
    "{module}: the uniform noise at key {key} has shape {got}; a value of this distribution "
    "draws {want} uniforms (the shape of a sample; a categorical's without its class dim)"
)
UNIFORM_DTYPE = (
    "{module}: the uniform noise at key {key} must be a floating-point tensor, got {dtype}"
)
NO_ICDF = (
    "{module}: {dist} has no icdf, so it cannot be sampled from uniform noise (generator or "
    "uniform_key); sample it with torch's global generator (no generator, no uniform_key)"
)
NO_MEDIAN = "{module}: {dist} has no median (default_interaction_type='median')"
LAST_NOT_PROBABILISTIC = (
    "ProbabilisticTensorDictSequential: the last module must be a ProbabilisticTensorDictModule "
    "(or a ProbabilisticTensorDictSequential), got {typ}"
)
COMPOSITE = (
    "ProbabilisticTensorDictSequential: {detail}; a CompositeDistribution over several "
    "probabilistic modules is not supported: pass return_composite=False to get the "
    "distribution of the last module"
)


class InteractionType(enum.StrEnum):
    """How a probabilistic module turns its distribution into a value, as in ``tensordict.nn``.

    ``RANDOM``: a sample (``rsample`` where the distribution has it); ``MODE``, ``MEDIAN``,
    ``MEAN``: that attribute (``MEAN`` averages ``n_empirical_estimate`` samples where the
    distribution has no mean); ``DETERMINISTIC``: the distribution's ``deterministic_sample``
    where it has one, else its mode when its support is enumerable (categorical, Bernoulli)
    and its mean otherwise. Strings of any case name them too.

    Example:
        >>> from tdfunc.nn import InteractionType
        >>> InteractionType("Random") is InteractionType.RANDOM, InteractionType.MODE.value
        (True, 'mode')
    """

    MODE = "mode"
    MEDIAN = "median"
    MEAN = "mean"
    RANDOM = "random"
    DETERMINISTIC = "deterministic"

    @classmethod
    def _missing_(cls, value: object) -> InteractionType | None:
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        return None


def _interaction(value: Any) -> InteractionType:
    raw = value.value if isinstance(value, enum.Enum) else value
    if isinstance(raw, str):
        for member in InteractionType:
            if member.value == raw.lower():
                return member
    raise ValueError(BAD_INTERACTION.format(names=[m.value for m in InteractionType], got=value))


def _add_suffix(path: KeyPath, suffix: str) -> KeyPath:
    return (*path[:-1], path[-1] + suffix)


def _base(dist: D.Distribution) -> D.Distribution:
    """The distribution an ``Independent`` wraps (its values are the wrapped one's)."""
    while isinstance(dist, D.Independent):
        dist = dist.base_dist
    return dist


def _inverse_categorical(probs: Tensor, u: Tensor) -> Tensor:
    """The class whose CDF interval holds ``u`` (the inverse CDF of a categorical)."""
    cdf = probs.cumsum(-1)
    index = (cdf < u.unsqueeze(-1) * cdf[..., -1:]).sum(-1)
    return index.clamp(max=probs.shape[-1] - 1)


def uniform_shape(dist: D.Distribution) -> torch.Size:
    """How many uniforms one value of ``dist`` takes (:func:`from_uniform`): the shape of a
    sample, without the class dim of a one-hot categorical.

    Example:
        >>> import torch
        >>> uniform_shape(torch.distributions.OneHotCategorical(logits=torch.zeros(4, 3)))
        torch.Size([4])
    """
    base = _base(dist)
    if isinstance(base, (D.Categorical, D.OneHotCategorical, D.Bernoulli)):
        return base.batch_shape
    return base.batch_shape + base.event_shape


def from_uniform(dist: D.Distribution, u: Tensor, owner: str = "from_uniform") -> Tensor:
    """A value of ``dist`` from uniform noise ``u`` in ``[0, 1)`` (of :func:`uniform_shape`):
    inverse-transform sampling, differentiable in the parameters where ``rsample`` is.

    Example:
        >>> import torch
        >>> d = torch.distributions.Categorical(probs=torch.tensor([0.2, 0.5, 0.3]))
        >>> [int(from_uniform(d, torch.tensor(u))) for u in (0.1, 0.3, 0.9)]
        [0, 1, 2]
    """
    base = _base(dist)
    if isinstance(base, D.OneHotCategorical):
        probs = base.probs
        index = _inverse_categorical(probs, u)
        return torch.nn.functional.one_hot(index, probs.shape[-1]).to(probs.dtype)
    if isinstance(base, D.Categorical):
        return _inverse_categorical(base.probs, u)
    if isinstance(base, D.Bernoulli):
        return (u < base.probs).to(base.probs.dtype)
    if type(base).icdf is D.Distribution.icdf:
        raise TypeError(NO_ICDF.format(module=owner, dist=type(base).__name__))
    finfo = torch.finfo(u.dtype)
    return base.icdf(u.clamp(finfo.tiny, 1.0 - finfo.eps))


class ProbabilisticTensorDictModule(nn.Module):
    """Build a distribution from entries of a container and write a value drawn from it.

    ``forward(td)`` reads the distribution's parameters at ``in_keys``, builds
    ``distribution_class(**params, **distribution_kwargs)`` and returns a **new** container:
    ``td`` plus the value under the out key (and its log-probability under
    ``log_prob_key`` with ``return_log_prob=True``). The module has no parameters: compute
    the distribution's parameters with a :class:`~tdfunc.nn.TensorDictModule` before it, in a
    :class:`ProbabilisticTensorDictSequential`. :meth:`get_dist` gives the distribution of a
    container, e.g. to score stored actions in a loss (``log_prob``, ``entropy``).

    Args:
        in_keys: the parameters' keys: a key or a list of keys (the last element of each key
            is the keyword it feeds: ``["loc", "scale"]``, ``("agent", "loc")`` feeds
            ``loc``), or a mapping from keywords to keys (``{"loc": "mu"}``).
        out_keys: the key of the value (a key, or a list of one key).
        default_interaction_type: how the value is chosen: ``"deterministic"`` (the
            default), ``"mode"``, ``"median"``, ``"mean"`` or ``"random"`` (see
            :class:`InteractionType`).
        distribution_class: a ``torch.distributions`` class, or a callable building a
            distribution from the parameters as keywords.
        distribution_kwargs: more keywords for ``distribution_class`` (constants).
        return_log_prob: also write the log-probability of the value.
        log_prob_key: where; default: the out key with ``_log_prob`` appended to its last
            element (``"action_log_prob"``, ``("agent", "action_log_prob")``).
        log_prob_keys: tensordict's list form of ``log_prob_key`` (one key).
        n_empirical_estimate: the number of samples ``"mean"`` averages for a distribution
            without a mean.
        generator: a ``torch.Generator`` (or an int seed of a new CPU one) that random
            values are drawn from (uniform noise, turned into a value as with
            ``uniform_key``); it advances at each call. Eager only: Dynamo (torch 2.13)
            refuses a generator inside ``torch.compile``; use ``uniform_key`` there.
        uniform_key: a key of the input holding uniform noise in ``[0, 1)`` shaped like
            the value (a categorical's without the class dim): random values are the
            distribution's inverse CDF of it. Reproducible, compiles with ``fullgraph=True``,
            and works under ``torch.vmap`` (which refuses torch's random ops by default).

    Raises:
        KeyError: (at call) a parameter or the uniform noise is missing (naming the key).
        TypeError: (at construction) a bad key, distribution class or generator; (at call)
            no icdf for uniform noise, or the class built something else than a distribution.
        ValueError: (at construction) not one out key, an unknown interaction type, a
            log-probability key that is the out key; (at call) uniform noise of another
            shape (naming the key).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc.nn import ProbabilisticTensorDictModule
        >>> module = ProbabilisticTensorDictModule(
        ...     in_keys=["loc", "scale"], out_keys=["action"],
        ...     distribution_class=torch.distributions.Normal, return_log_prob=True)
        >>> td = tdfunc.TensorDict(loc=torch.zeros(3), scale=torch.ones(3), batch_size=[3])
        >>> out = module(td)
        >>> out["action"].tolist(), out["action_log_prob"].shape, "action" in td
        ([0.0, 0.0, 0.0], torch.Size([3]), False)
        >>> module.get_dist(out).entropy().shape
        torch.Size([3])
    """

    def __init__(
        self,
        in_keys: Key | Sequence[Key] | Mapping[str, Key],
        out_keys: Key | Sequence[Key] | None = None,
        *,
        default_interaction_type: InteractionType | str = InteractionType.DETERMINISTIC,
        distribution_class: Any = None,
        distribution_kwargs: Mapping[str, Any] | None = None,
        return_log_prob: bool = False,
        log_prob_keys: Sequence[Key] | None = None,
        log_prob_key: Key | None = None,
        n_empirical_estimate: int = 1000,
        generator: torch.Generator | int | None = None,
        uniform_key: Key | None = None,
    ) -> None:
        super().__init__()
        # the arguments, to build a variant (with_interaction_type); the generator is shared
        self._init_args: dict[str, Any] = {
            "in_keys": in_keys,
            "out_keys": out_keys,
            "distribution_class": distribution_class,
            "distribution_kwargs": distribution_kwargs,
            "return_log_prob": return_log_prob,
            "log_prob_keys": log_prob_keys,
            "log_prob_key": log_prob_key,
            "n_empirical_estimate": n_empirical_estimate,
            "uniform_key": uniform_key,
        }
        if isinstance(in_keys, Mapping):
            for name in in_keys:
                if not isinstance(name, str) or not name:
                    raise TypeError(BAD_KWARG.format(name=name))
            names = tuple(in_keys)
            in_paths = tuple(to_path(k, "in_keys") for k in in_keys.values())
        else:
            in_paths = to_paths(in_keys, "in_keys")
            names = tuple(p[-1] for p in in_paths)
        if out_keys is None:
            raise ValueError(NO_OUT_KEY)
        out_paths = to_paths(out_keys, "out_keys")
        if len(out_paths) != 1:
            raise ValueError(ONE_OUT_KEY.format(out_keys=[public_key(p) for p in out_paths]))
        if not callable(distribution_class):
            raise TypeError(NOT_CALLABLE_DIST.format(typ=type(distribution_class).__name__))
        if log_prob_keys is not None:
            lp = to_paths(log_prob_keys, "log_prob_keys")
            if len(lp) != 1:
                raise ValueError(LOG_PROB_KEYS.format(got=[public_key(p) for p in lp]))
            log_prob_key = lp[0]
        lp_path = (
            _add_suffix(out_paths[0], "_log_prob")
            if log_prob_key is None
            else to_path(log_prob_key, "log_prob_key")
        )
        written = (out_paths[0], lp_path) if return_log_prob else out_paths
        check_out_paths(written)
        if isinstance(generator, int) and not isinstance(generator, bool):
            generator = torch.Generator().manual_seed(generator)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(BAD_GENERATOR.format(typ=type(generator).__name__))
        uniform = None if uniform_key is None else to_path(uniform_key, "uniform_key")
        if generator is not None and uniform is not None:
            raise ValueError(BOTH_SOURCES)
        self.default_interaction_type = _interaction(default_interaction_type)
        self.distribution_class = distribution_class
        self.distribution_kwargs = dict(distribution_kwargs or {})
        self.return_log_prob = bool(return_log_prob)
        self.n_empirical_estimate = int(n_empirical_estimate)
        self.generator = generator
        self._init_args["generator"] = generator
        self._lp_path = lp_path
        self._name = (
            f"ProbabilisticTensorDictModule(distribution_class="
            f"{getattr(distribution_class, '__name__', type(distribution_class).__name__)}, "
            f"in_keys={[public_key(p) for p in in_paths]}, "
            f"out_keys={[public_key(p) for p in written]})"
        )
        # everything a call needs, in one immutable tuple (one cheap guard under compile)
        self._route = (
            in_paths,
            names,
            out_paths[0],
            written,
            make_plan(written, range(len(written))),
            uniform,
            self._name,
        )

    # ------------------------------------------------------------------ keys
    @property
    def in_keys(self) -> list[Key]:
        """The keys read from the input: the parameters', then ``uniform_key`` if any.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> ProbabilisticTensorDictModule({"probs": "p"}, "a",
            ...     distribution_class=torch.distributions.Bernoulli, uniform_key="u").in_keys
            ['p', 'u']
        """
        in_paths, uniform = self._route[0], self._route[5]
        return [public_key(p) for p in (*in_paths, *((uniform,) if uniform else ()))]

    @property
    def out_keys(self) -> list[Key]:
        """The keys written: the value's, then the log-probability's with ``return_log_prob``.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> ProbabilisticTensorDictModule("logits", ("agent", "action"), return_log_prob=True,
            ...     distribution_class=torch.distributions.Categorical).out_keys
            [('agent', 'action'), ('agent', 'action_log_prob')]
        """
        return [public_key(p) for p in self._route[3]]

    @property
    def dist_params_keys(self) -> list[Key]:
        """The keys of the distribution's parameters.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> ProbabilisticTensorDictModule(["loc", "scale"], "x",
            ...     distribution_class=torch.distributions.Normal).dist_params_keys
            ['loc', 'scale']
        """
        return [public_key(p) for p in self._route[0]]

    @property
    def dist_sample_keys(self) -> list[Key]:
        """The key of the value, in a list.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> ProbabilisticTensorDictModule(["loc", "scale"], "x",
            ...     distribution_class=torch.distributions.Normal).dist_sample_keys
            ['x']
        """
        return [public_key(self._route[2])]

    @property
    def log_prob_key(self) -> Key:
        """Where the log-probability is written (with ``return_log_prob=True``).

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> ProbabilisticTensorDictModule(["loc", "scale"], "x",
            ...     distribution_class=torch.distributions.Normal).log_prob_key
            'x_log_prob'
        """
        return public_key(self._lp_path)

    @property
    def log_prob_keys(self) -> list[Key]:
        """:attr:`log_prob_key` in a list (tensordict's form).

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> ProbabilisticTensorDictModule(["loc", "scale"], "x", log_prob_key="lp",
            ...     distribution_class=torch.distributions.Normal).log_prob_keys
            ['lp']
        """
        return [self.log_prob_key]

    @property
    def uniform_key(self) -> Key | None:
        """The key of the uniform noise random values are drawn from, or ``None``.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> ProbabilisticTensorDictModule(["loc", "scale"], "x", uniform_key="u",
            ...     distribution_class=torch.distributions.Normal).uniform_key
            'u'
        """
        uniform = self._route[5]
        return None if uniform is None else public_key(uniform)

    def with_interaction_type(self, interaction_type: InteractionType | str) -> Any:
        """A new module like this one that chooses its value by ``interaction_type`` (the
        pure form of tensordict's ``set_interaction_type`` block; this one is unchanged).

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> m = ProbabilisticTensorDictModule("logits", "a",
            ...     distribution_class=torch.distributions.Categorical)
            >>> td = tdfunc.TensorDict(logits=torch.tensor([[0.0, 9.0]]), batch_size=[1])
            >>> m.with_interaction_type("mode")(td)["a"].tolist(), m.default_interaction_type.value
            ([1], 'deterministic')
        """
        new = type(self)(**{**self._init_args, "default_interaction_type": interaction_type})
        return new.train(self.training)

    # ------------------------------------------------------------------ distribution
    def get_dist(self, td: Any) -> D.Distribution:
        """The distribution of ``td``: built from its entries at the parameters' keys.

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> m = ProbabilisticTensorDictModule("logits", "a",
            ...     distribution_class=torch.distributions.Categorical)
            >>> td = tdfunc.TensorDict(logits=torch.zeros(2, 4), a=torch.tensor([0, 3]),
            ...     batch_size=[2])
            >>> dist = m.get_dist(td)
            >>> dist.log_prob(td["a"]).tolist(), dist.entropy().shape
            ([-1.3862943649291992, -1.3862943649291992], torch.Size([2]))
        """
        in_paths, names, _, _, _, _, name = self._route
        if not isinstance(td, Node):
            raise TypeError(NOT_A_CONTAINER.format(module=name, typ=type(td).__name__))
        params = {n: read_key(td, p, name) for n, p in zip(names, in_paths)}
        dist = self.distribution_class(**params, **self.distribution_kwargs)
        if not isinstance(dist, D.Distribution):
            raise TypeError(NOT_A_DISTRIBUTION.format(module=name, typ=type(dist).__name__))
        return dist

    build_dist_from_params = get_dist

    def log_prob(self, td: Any, *, dist: D.Distribution | None = None) -> Tensor:
        """The log-probability of the value stored in ``td`` at the out key, under the
        distribution of ``td`` (or ``dist``).

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> m = ProbabilisticTensorDictModule(["loc", "scale"], "x",
            ...     distribution_class=torch.distributions.Normal)
            >>> td = tdfunc.TensorDict(loc=torch.zeros(1), scale=torch.ones(1), x=torch.zeros(1))
            >>> round(float(m.log_prob(td)), 4)
            -0.9189
        """
        if dist is None:
            dist = self.get_dist(td)
        return dist.log_prob(read_key(td, self._route[2], self._route[6]))

    # ------------------------------------------------------------------ values
    def _uniform(self, dist: D.Distribution, td: Any, sample_shape: torch.Size) -> Tensor | None:
        """The uniform noise of a random value: read at ``uniform_key``, or drawn from the
        generator; ``None`` for torch's own sampling (the global generator)."""
        uniform, name = self._route[5], self._route[6]
        want = sample_shape + uniform_shape(dist)
        if uniform is not None:
            u = read_key(td, uniform, name)
            if not isinstance(u, Tensor) or not u.is_floating_point():
                what = u.dtype if isinstance(u, Tensor) else type(u).__name__
                raise TypeError(UNIFORM_DTYPE.format(module=name, key=fmt_key(uniform), dtype=what))
            if u.shape != want:
                raise ValueError(
                    UNIFORM_SHAPE.format(
                        module=name, key=fmt_key(uniform), got=tuple(u.shape), want=tuple(want)
                    )
                )
            return u
        if self.generator is None:
            return None
        # the dtype and device of the parameters (the first one)
        like = read_key(td, self._route[0][0], name) if self._route[0] else torch.zeros(())
        dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
        return torch.rand(want, generator=self.generator, dtype=dtype, device=like.device)

    def _sample(self, dist: D.Distribution, td: Any, sample_shape: torch.Size) -> Tensor:
        u = self._uniform(dist, td, sample_shape)
        if u is not None:
            return from_uniform(dist, u, self._route[6])
        return dist.rsample(sample_shape) if dist.has_rsample else dist.sample(sample_shape)

    def _value(self, dist: D.Distribution, td: Any) -> Tensor:
        kind = self.default_interaction_type
        if kind is InteractionType.DETERMINISTIC:
            fixed = getattr(dist, "deterministic_sample", None)
            if fixed is not None:
                return fixed
            enumerable = type(_base(dist)).has_enumerate_support
            kind = InteractionType.MODE if enumerable else InteractionType.MEAN
        if kind is InteractionType.MODE:
            return dist.mode
        if kind is InteractionType.MEDIAN:
            if not hasattr(type(dist), "median"):
                raise NotImplementedError(
                    NO_MEDIAN.format(module=self._route[6], dist=type(dist).__name__)
                )
            return dist.median  # type: ignore[attr-defined]
        if kind is InteractionType.MEAN:
            if type(dist).mean is not D.Distribution.mean:
                return dist.mean
            n = torch.Size([self.n_empirical_estimate])
            return self._sample(dist, td, n).mean(0)
        return self._sample(dist, td, torch.Size())

    def forward(self, td: Any = None, **tensors: Any) -> Any:
        """Build the distribution of ``td`` and return ``td`` plus its value (and the value's
        log-probability with ``return_log_prob``), a new container.

        Called with keyword tensors named after the parameters' keys (``m(loc=..., scale=...)``)
        it returns the value (and the log-probability) instead, as in ``tensordict.nn``.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule
            >>> m = ProbabilisticTensorDictModule(["loc", "scale"], "x",
            ...     distribution_class=torch.distributions.Normal)
            >>> m(loc=torch.ones(2), scale=torch.ones(2)).tolist()
            [1.0, 1.0]
        """
        if tensors:
            in_paths = (*self._route[0], *((self._route[5],) if self._route[5] else ()))
            return _keyword_call(self, in_paths, self._route[3], td, tensors)
        if td is None:
            raise TypeError(
                NO_INPUT.format(
                    module=self._route[6], names=[kwarg_name(p) for p in self._route[0]]
                )
            )
        return self._forward(td)

    def _forward(self, td: Any) -> Any:
        dist = self.get_dist(td)
        value = self._value(dist, td)
        outputs = (value, dist.log_prob(value)) if self.return_log_prob else (value,)
        return apply_plan(td, self._route[4], outputs, self._route[6], ())

    def extra_repr(self) -> str:
        cls = self.distribution_class
        return (
            f"in_keys={self.in_keys}, out_keys={self.out_keys}, "
            f"distribution_class={getattr(cls, '__name__', type(cls).__name__)}, "
            f"default_interaction_type={self.default_interaction_type.value}"
        )


_PROBABILISTIC = (ProbabilisticTensorDictModule,)


class ProbabilisticTensorDictSequential(TensorDictSequential):
    """A :class:`~tdfunc.nn.TensorDictSequential` whose last module is probabilistic: the
    modules before it compute the parameters of its distribution.

    A call runs every module and returns a new container with their outputs (the value, and
    its log-probability with ``return_log_prob``). :meth:`get_dist` gives the distribution
    of a container (the parameters computed from it, nothing written into it), e.g. to
    score stored actions in a loss; :meth:`log_prob` the log-probability of the value stored
    in it.

    Args:
        *modules: key-routed modules, the last a :class:`ProbabilisticTensorDictModule` (or
            another :class:`ProbabilisticTensorDictSequential`).
        return_composite: ``False`` (or ``None`` with one probabilistic module): the
            distribution is the last module's. ``True`` (a ``CompositeDistribution`` over all
            probabilistic modules) is not supported.
        selected_out_keys: as :class:`~tdfunc.nn.TensorDictSequential`'s.

    Raises:
        TypeError: the last module is not probabilistic.
        ValueError: ``return_composite=True``, or several probabilistic modules without
            ``return_composite=False``.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc.nn import (ProbabilisticTensorDictModule,
        ...     ProbabilisticTensorDictSequential, TensorDictModule)
        >>> policy = ProbabilisticTensorDictSequential(
        ...     TensorDictModule(torch.nn.Linear(3, 4), in_keys="obs", out_keys="logits"),
        ...     ProbabilisticTensorDictModule("logits", "action", return_log_prob=True,
        ...         distribution_class=torch.distributions.Categorical))
        >>> td = tdfunc.TensorDict(obs=torch.randn(5, 3), batch_size=[5])
        >>> out = policy(td)
        >>> out["action"].shape, out["action_log_prob"].shape, sorted(td.keys())
        (torch.Size([5]), torch.Size([5]), ['obs'])
        >>> policy.log_prob(out).shape, policy.get_dist(td).entropy().shape
        (torch.Size([5]), torch.Size([5]))
    """

    def __init__(
        self,
        *modules: nn.Module,
        return_composite: bool | None = None,
        selected_out_keys: Sequence[Key] | None = None,
    ) -> None:
        if modules and not isinstance(
            modules[-1], (*_PROBABILISTIC, ProbabilisticTensorDictSequential)
        ):
            raise TypeError(LAST_NOT_PROBABILISTIC.format(typ=type(modules[-1]).__name__))
        if return_composite:
            raise ValueError(COMPOSITE.format(detail="return_composite=True"))
        count = sum(
            isinstance(m, (*_PROBABILISTIC, ProbabilisticTensorDictSequential)) for m in modules
        )
        if count > 1 and return_composite is None:
            raise ValueError(COMPOSITE.format(detail=f"{count} probabilistic modules"))
        super().__init__(*modules, selected_out_keys=selected_out_keys)
        self.return_composite = False

    @property
    def _last(self) -> Any:
        return self._steps[-1]

    @property
    def default_interaction_type(self) -> InteractionType:
        """The last module's ``default_interaction_type``.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
            >>> ProbabilisticTensorDictSequential(ProbabilisticTensorDictModule("logits", "a",
            ...     distribution_class=torch.distributions.Categorical)).default_interaction_type
            <InteractionType.DETERMINISTIC: 'deterministic'>
        """
        return self._last.default_interaction_type

    @property
    def dist_params_keys(self) -> list[Key]:
        """The keys of the last module's distribution parameters.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
            >>> ProbabilisticTensorDictSequential(ProbabilisticTensorDictModule("logits", "a",
            ...     distribution_class=torch.distributions.Categorical)).dist_params_keys
            ['logits']
        """
        return self._last.dist_params_keys

    @property
    def dist_sample_keys(self) -> list[Key]:
        """The key of the last module's value, in a list.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
            >>> ProbabilisticTensorDictSequential(ProbabilisticTensorDictModule("logits", "a",
            ...     distribution_class=torch.distributions.Categorical)).dist_sample_keys
            ['a']
        """
        return self._last.dist_sample_keys

    @property
    def log_prob_key(self) -> Key:
        """Where the last module writes the log-probability.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
            >>> ProbabilisticTensorDictSequential(ProbabilisticTensorDictModule("logits", "a",
            ...     distribution_class=torch.distributions.Categorical)).log_prob_key
            'a_log_prob'
        """
        return self._last.log_prob_key

    @property
    def log_prob_keys(self) -> list[Key]:
        """:attr:`log_prob_key` in a list.

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
            >>> ProbabilisticTensorDictSequential(ProbabilisticTensorDictModule("logits", "a",
            ...     distribution_class=torch.distributions.Categorical)).log_prob_keys
            ['a_log_prob']
        """
        return self._last.log_prob_keys

    def get_dist_params(self, td: Any) -> Any:
        """``td`` plus what the modules before the last one write (the distribution's
        parameters), a new container.

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import (ProbabilisticTensorDictModule,
            ...     ProbabilisticTensorDictSequential, TensorDictModule)
            >>> seq = ProbabilisticTensorDictSequential(
            ...     TensorDictModule(lambda x: x + 1, in_keys="x", out_keys="loc"),
            ...     ProbabilisticTensorDictModule("loc", "y", distribution_kwargs={"scale": 1.0},
            ...         distribution_class=torch.distributions.Normal))
            >>> sorted(seq.get_dist_params(tdfunc.TensorDict(x=torch.zeros(2))).keys())
            ['loc', 'x']
        """
        if not isinstance(td, Node):
            raise TypeError(NOT_A_CONTAINER.format(module=self._name, typ=type(td).__name__))
        out = td
        for m in self._steps[:-1]:
            out = m(out)
        return out

    def build_dist_from_params(self, td: Any) -> D.Distribution:
        """The last module's distribution from a container that holds its parameters.

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
            >>> seq = ProbabilisticTensorDictSequential(ProbabilisticTensorDictModule("logits",
            ...     "a", distribution_class=torch.distributions.Categorical))
            >>> seq.build_dist_from_params(tdfunc.TensorDict(logits=torch.zeros(3))).probs.tolist()
            [0.3333333432674408, 0.3333333432674408, 0.3333333432674408]
        """
        return self._last.build_dist_from_params(td)

    def get_dist(self, td: Any) -> D.Distribution:
        """The distribution of ``td``: the parameters computed from it by the modules before
        the last one (nothing is written into ``td``), then the last module's distribution.

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import (ProbabilisticTensorDictModule,
            ...     ProbabilisticTensorDictSequential, TensorDictModule)
            >>> seq = ProbabilisticTensorDictSequential(
            ...     TensorDictModule(lambda x: x * 0, in_keys="obs", out_keys="logits"),
            ...     ProbabilisticTensorDictModule("logits", "a",
            ...         distribution_class=torch.distributions.Categorical))
            >>> seq.get_dist(tdfunc.TensorDict(obs=torch.ones(2, 4), batch_size=[2])).probs[0].tolist()
            [0.25, 0.25, 0.25, 0.25]
        """
        return self._last.get_dist(self.get_dist_params(td))

    def log_prob(self, td: Any, *, dist: D.Distribution | None = None) -> Tensor:
        """The log-probability of the value stored in ``td`` at the last module's out key.

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import (ProbabilisticTensorDictModule,
            ...     ProbabilisticTensorDictSequential, TensorDictModule)
            >>> seq = ProbabilisticTensorDictSequential(
            ...     TensorDictModule(lambda x: x * 0, in_keys="obs", out_keys="logits"),
            ...     ProbabilisticTensorDictModule("logits", "a",
            ...         distribution_class=torch.distributions.Categorical))
            >>> td = tdfunc.TensorDict(obs=torch.ones(1, 2), a=torch.tensor([1]), batch_size=[1])
            >>> round(float(seq.log_prob(td)), 4)
            -0.6931
        """
        if dist is None:
            dist = self.get_dist(td)
        return self._last.log_prob(td, dist=dist)

    def with_interaction_type(self, interaction_type: InteractionType | str) -> Any:
        """A new sequence of the same modules whose probabilistic ones choose their values by
        ``interaction_type`` (this one is unchanged).

        Example:
            >>> import torch
            >>> from tdfunc.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential
            >>> seq = ProbabilisticTensorDictSequential(ProbabilisticTensorDictModule("logits",
            ...     "a", distribution_class=torch.distributions.Categorical))
            >>> seq.with_interaction_type("random").default_interaction_type.value
            'random'
        """
        modules = [
            m.with_interaction_type(interaction_type)
            if isinstance(m, (*_PROBABILISTIC, ProbabilisticTensorDictSequential))
            else m
            for m in self._steps
        ]
        return type(self)(
            *modules,
            return_composite=False if len(modules) > 1 else None,
            selected_out_keys=self.selected_out_keys,
        )

    def __getitem__(self, index: int | slice) -> Any:
        """Module ``index``, or a new sequence of a slice of the modules: probabilistic when
        the slice ends with a probabilistic module, a plain
        :class:`~tdfunc.nn.TensorDictSequential` otherwise (as in ``tensordict.nn``).

        Example:
            >>> import torch
            >>> from tdfunc.nn import (ProbabilisticTensorDictModule,
            ...     ProbabilisticTensorDictSequential, TensorDictModule)
            >>> seq = ProbabilisticTensorDictSequential(
            ...     TensorDictModule(lambda x: x, in_keys="obs", out_keys="logits"),
            ...     ProbabilisticTensorDictModule("logits", "a",
            ...         distribution_class=torch.distributions.Categorical))
            >>> type(seq[:1]).__name__, type(seq[1:]).__name__, type(seq[0]).__name__
            ('TensorDictSequential', 'ProbabilisticTensorDictSequential', 'TensorDictModule')
        """
        if not isinstance(index, slice):
            return super().__getitem__(index)
        modules = list(self._steps[index])
        if modules and isinstance(
            modules[-1], (*_PROBABILISTIC, ProbabilisticTensorDictSequential)
        ):
            count = sum(
                isinstance(m, (*_PROBABILISTIC, ProbabilisticTensorDictSequential)) for m in modules
            )
            return type(self)(*modules, return_composite=False if count > 1 else None)
        return TensorDictSequential(*modules)


__all__ = ["InteractionType", "ProbabilisticTensorDictModule", "ProbabilisticTensorDictSequential"]
