"""Policies by name: built-ins register themselves; anything else by dotted path.

``resolve("eviction", "arc")`` gives the ARC class; ``resolve("eviction",
"mypkg.policies:MyPolicy")`` (or ``mypkg.policies.MyPolicy``) imports a user's own, so a new
policy plugs into the engine and the benchmark without touching kvtier.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.errors import InvalidArgumentError

T = TypeVar("T")
_REGISTRY: dict[str, dict[str, Any]] = {}


def register(kind: str, name: str) -> Callable[[T], T]:
    """Class decorator: make ``name`` resolve to the class for ``kind``."""

    def deco(obj: T) -> T:
        _REGISTRY.setdefault(kind, {})[name] = obj
        return obj

    return deco


def names(kind: str) -> list[str]:
    return sorted(_REGISTRY.get(kind, {}))


def resolve(kind: str, name: str) -> Any:
    """The policy registered as ``name`` for ``kind``, or the object at a dotted path."""
    known = _REGISTRY.get(kind, {})
    if name in known:
        return known[name]
    if "." in name or ":" in name:
        module, _, attr = name.replace(":", ".").rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"cannot import {kind} policy {name!r}: {exc}"
            ) from None
    raise InvalidArgumentError(
        f"unknown {kind} policy {name!r}; known: {', '.join(sorted(known)) or 'none'} "
        "(or give a dotted path such as mypkg.module:MyPolicy)"
    )
