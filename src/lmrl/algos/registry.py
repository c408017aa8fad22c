"""One generic name -> function registry, instantiated once per algorithm family.

Canonical names are the recipes' own (``gae``, ``grpo``, ``vanilla``, ``low_var_kl``...);
the recipes' aliases (``k3``, ``grpo_vectorized``...) resolve through the single ``ALIASES``
table below, so a verl command line carries over unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)

# alias -> canonical name, for every family. The only place that knows the recipes' aliases.
ALIASES: dict[str, str] = {
    # KL estimators
    "kl": "k1",
    "mse": "k2",
    "low_var_kl": "k3",
    # advantage estimators (verl registers loop and vectorized twins; ours are all vectorized)
    "grpo_vectorized": "grpo",
    "rloo_vectorized": "rloo",
}


class Registry(Generic[F]):
    """A named family of interchangeable functions sharing one signature.

    Register with ``@registry.register("name")``; look up with ``registry.get("name")``,
    which resolves aliases and raises a ``ValueError`` listing the valid names.
    """

    def __init__(self, family: str):
        self.family = family
        self._entries: dict[str, F] = {}
        self._needs: dict[str, frozenset[str]] = {}
        self._traits: dict[str, frozenset[str]] = {}

    def register(
        self, name: str, *, needs: tuple[str, ...] = (), traits: tuple[str, ...] = ()
    ) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``.

        Args:
            name: the recipes' name for it.
            needs: optional inputs this entry cannot do without (e.g. an estimator's
                ``values``), so callers can prepare them without branching on the name.
            traits: what this entry does that others may not (e.g. an engine's
                ``reports_rows``), so a plan asks the registry instead of the name.
        """

        def decorator(fn: F) -> F:
            if name in self._entries or name in ALIASES:
                raise ValueError(f"{self.family} {name!r} is already registered")
            self._entries[name] = fn
            self._needs[name] = frozenset(needs)
            self._traits[name] = frozenset(traits)
            return fn

        return decorator

    def needs(self, name: str) -> frozenset[str]:
        """The inputs ``name`` requires (declared at registration)."""
        return self._needs[self.canonical(name)]

    def traits(self, name: str) -> frozenset[str]:
        """What ``name`` does that others may not (declared at registration)."""
        return self._traits[self.canonical(name)]

    def canonical(self, name: str) -> str:
        """The registered name that ``name`` (possibly an alias) stands for."""
        resolved = ALIASES.get(name, name)
        if resolved not in self._entries:
            choices = ", ".join(self.names())
            raise ValueError(f"unknown {self.family} {name!r}; valid names: {choices}")
        return resolved

    def get(self, name: str) -> F:
        return self._entries[self.canonical(name)]

    def names(self, aliases: bool = False) -> list[str]:
        """Registered names, sorted; with ``aliases=True`` the aliases that resolve here too."""
        names = list(self._entries)
        if aliases:
            names += [a for a, c in ALIASES.items() if c in self._entries]
        return sorted(names)

    def __contains__(self, name: str) -> bool:
        return ALIASES.get(name, name) in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.family!r}, {self.names()})"
