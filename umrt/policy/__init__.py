"""Policies by name: the registry every front end (CLI, bench, runtime) uses.

>>> from umrt.policy import make_policy, POLICY_NAMES
>>> policy = make_policy("um")

Each name maps to a ``"module:Class"`` path (:data:`umrt.registry.POLICIES`) that is imported only when the
policy is asked for, so that a policy whose module is heavy (or not built in
this checkout) costs nothing to the others. Every class is constructed as
``cls(trace=None, **options)``; only the oracle and ``swapadvisor`` read
``trace`` (both plan ahead from the whole trace), the others ignore it.
"""
from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING

from umrt.errors import ConfigError
from umrt.policy.base import Policy, PolicyContext
from umrt.registry import POLICIES, POLICY_NAMES  # the names live in a leaf module config can import

if TYPE_CHECKING:  # pragma: no cover
    from umrt.trace.events import Trace

__all__ = ["POLICY_NAMES", "POLICIES", "Policy", "PolicyContext", "make_policy", "policy_class", "available"]



def policy_class(name: str) -> type[Policy]:
    """The class registered under ``name``.

    Raises :class:`~umrt.errors.ConfigError` for an unknown name (the message
    lists the valid ones) or for a policy whose module is not available in
    this installation.
    """
    try:
        target = POLICIES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown policy {name!r}; valid policies: {', '.join(POLICY_NAMES)}"
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only a missing policy module means "not available"; a missing
        # dependency *inside* it is a real bug and must surface as such.
        if exc.name is None or not module_name.startswith(exc.name):
            raise
        raise ConfigError(
            f"policy {name!r} is unavailable in this installation ({module_name} is not built)"
        ) from None
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ConfigError(
            f"policy {name!r} is unavailable in this installation ({target} is not defined)"
        ) from None


def available(name: str) -> bool:
    """Whether ``name`` is a known policy whose module can be imported here."""
    try:
        policy_class(name)
    except ConfigError:
        return False
    return True


def make_policy(name: str, trace: Trace | None = None, **options) -> Policy:
    """Build the policy registered under ``name``.

    ``trace`` is handed to the constructor (the oracle and ``swapadvisor``
    plan from it; the other policies ignore it). ``options`` are passed through as keyword
    arguments; an option the policy does not take is a
    :class:`~umrt.errors.ConfigError`, not a ``TypeError``.
    """
    cls = policy_class(name)
    if options:
        params = inspect.signature(cls).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = sorted(set(options) - set(params)) if not takes_any else []
        if unknown:
            kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            valid = sorted(p for p, spec in params.items() if p != "trace" and spec.kind in kinds)
            raise ConfigError(
                f"policy {name!r} takes no option {', '.join(map(repr, unknown))}"
                + (f"; its options: {', '.join(valid)}" if valid else "; it takes no options")
            )
    return cls(trace=trace, **options)
