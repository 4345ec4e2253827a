"""Worker methods that declare how the driver calls them (veRL's `@register(dispatch_mode=…)`),
and the driver-side callables generated from those declarations.

    class Worker:
        @register(Dispatch.DP_COMPUTE, role="actor", name="compute_logprobs")
        def actor_logprobs(self, batch): ...

    actor = role_view(group, Worker, "actor")       # any group: LocalWorkerGroup, RayWorkerGroup
    actor.compute_logprobs(batch)                    # = group.dp_compute("actor_logprobs", batch)

A declaration is (mode, role, name): the role whose view gets the callable (None: the view of
the worker itself, `role_view(group, cls)`), and the callable's name there (default: the
method's). The modes (W workers; `distributed.dispatch` for how rows are cut):

    ONE_TO_ALL   the same arguments to every worker; returns worker 0's result (the workers
                 hold the same state: setup, weight sync, checkpoints)
    RANK_ZERO    worker 0 alone (generation that must draw from one random stream; reading
                 worker 0's state)
    DP_COMPUTE   the first argument, a batch, cut into W token-balanced parts, one per
                 worker; the results put back in the batch's row order (`dp_compute`)
    DP_SPLIT     the first argument cut into W contiguous slices, each worker told its first
                 row (`first`, the method's second argument); the slices' results in order,
                 joined by the declaration's `collect` (default: the list)
    DP_SHARES    an update: every worker gets the arguments (the batch and the plan of its
                 mini-batches) and trains on its own token-balanced share of each mini-batch,
                 all-reducing gradients in each step; returns worker 0's metrics (reduced:
                 the same on every worker)

A declaration may name a second mode, taken when the view is made with that flag set
(`register(RANK_ZERO, DP_SPLIT, when="split")`: generation split over the workers only when
rollout.dispatch asks for it); a method that may run DP_SPLIT takes `first` in either mode
(0 when the whole batch goes to worker 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"
    DP_SPLIT = "dp_split"
    DP_SHARES = "dp_shares"


@dataclass(frozen=True)
class Registered:
    """What `register` attaches to a worker method."""

    mode: Dispatch
    role: str | None
    name: str | None
    alt_mode: Dispatch | None = None
    when: str | None = None
    collect: Callable[[list[Any]], Any] | None = None

    @property
    def takes_first(self) -> bool:
        """The method takes DP_SPLIT's `first` (its second argument) whatever the mode."""
        return Dispatch.DP_SPLIT in (self.mode, self.alt_mode)


ATTR = "__dispatch__"


def register(mode: Dispatch, alt_mode: Dispatch | None = None, *, role: str | None = None, name: str | None = None,
             when: str | None = None, collect: Callable[[list[Any]], Any] | None = None,
             ) -> Callable[[Callable], Callable]:
    """Declare how the driver calls the decorated worker method (module docstring)."""
    if (alt_mode is None) != (when is None):
        raise ValueError("register: a second dispatch mode needs the flag that selects it (when=...), and back")

    def mark(fn: Callable) -> Callable:
        setattr(fn, ATTR, Registered(mode, role, name, alt_mode, when, collect))
        return fn

    return mark


def declarations(cls: type) -> dict[str, Registered]:
    """{method name: declaration} of every registered method of `cls` (its bases included)."""
    out = {}
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            if hasattr(value, ATTR):
                out[attr] = getattr(value, ATTR)
    return out


def call(group: Any, mode: Dispatch, method: str, *args: Any) -> Any:
    """`method(*args)` over `group` in `mode` (module docstring)."""
    if mode is Dispatch.ONE_TO_ALL or mode is Dispatch.DP_SHARES:
        return group.one_to_all(method, *args)[0]
    if mode is Dispatch.RANK_ZERO:
        return group.rank_zero(method, *args)
    if mode is Dispatch.DP_COMPUTE:
        return group.dp_compute(method, *args)
    if mode is Dispatch.DP_SPLIT:
        return group.dp_split(method, *args)
    raise ValueError(f"unknown dispatch mode {mode}")


class RoleView:
    """A role as the driver sees it: one generated callable per registered method of the
    role, plus the plain facts `info` the driver reads (e.g. the engine's kind)."""

    def __init__(self, role: str | None, group: Any, methods: dict[str, Callable[..., Any]], info: dict[str, Any]):
        self.role, self.group = role, group
        for key, value in {**info, **methods}.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"<{self.role or 'worker'} over {type(self.group).__name__} of {self.group.world_size}>"


def role_view(group: Any, cls: type, role: str | None = None, flags: dict[str, bool] | None = None,
              **info: Any) -> RoleView:
    """The callables of `role`'s registered methods of worker class `cls` over `group` (None:
    the methods registered without a role), each dispatching as declared; `flags` select a
    declaration's second mode."""
    flags = flags or {}
    methods = {}
    for attr, d in declarations(cls).items():
        if d.role != role:
            continue
        mode = d.alt_mode if d.when is not None and flags.get(d.when) else d.mode
        methods[d.name or attr] = _bound(group, mode, attr, d)
    return RoleView(role, group, methods, info)


def _bound(group: Any, mode: Dispatch, method: str, d: Registered) -> Callable[..., Any]:
    def dispatched(*args: Any) -> Any:
        if mode is Dispatch.DP_SPLIT:
            out = call(group, mode, method, *args)
            return d.collect(out) if d.collect is not None else out
        if d.takes_first:  # the whole batch, whose first row is row 0
            args = (args[0], 0, *args[1:])
        return call(group, mode, method, *args)

    dispatched.__name__ = dispatched.__qualname__ = method
    dispatched.__doc__ = f"`{method}` of every worker of the group, dispatched {mode.value}."
    return dispatched
