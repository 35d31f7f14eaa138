"""One plug-in seam per kind: a ``Registry`` of names to lazily imported objects.

Every kind of plug-in (rollout engines, train engines, reward functions, environments, policy
losses, advantage estimators) has one registry in its package's face, e.g.
``libs.engines.ENGINES``. Built-ins are listed as
``"module:Attr"`` strings, so nothing heavy is imported until one is used (``rlstream --help``
imports no torch). A user plug-in is named by its dotted path, ``my.module:MyEngine``, anywhere a
built-in name is accepted, or registered by code with ``REGISTRY.register("name", obj)``.

Every registry builds its objects the same way: ``cls(config, ctx)``: the plug-in's own config
section and a small context object of its kind (losses and advantage estimators, which need no
context, are ``cls(config)``). What an object can do is declared as class
attributes (capabilities), never inferred from its name.

What this is not: a packaging or entry-point system; ``module:Attr`` must be importable, from
the import path or from directories named for it (``load_object(ref, dirs)``: the module is looked
up there by name and imported as itself; sys.path is left alone).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_dotted(ref: str) -> bool:
    """True for ``package.module:Attr`` references."""
    return bool(_DOTTED.match(ref))


def _import_from(name: str, dirs: Sequence[str | Path]) -> None:
    """Import the top-level module or package of ``name`` from the first of ``dirs`` that has it,
    under its own name, unless it is imported already (importlib's "import a source file" recipe)."""
    top = name.partition(".")[0]
    if top in sys.modules:
        return
    spec = importlib.machinery.PathFinder.find_spec(top, [str(Path(d).resolve()) for d in dirs])
    if spec is None or spec.loader is None:
        return  # not there: the import path decides
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[top]
        raise


def load_object(ref: str, dirs: Sequence[str | Path] = ()) -> Any:
    """Import ``package.module:attr`` (``attr`` may be dotted); ConfigError says what failed.
    ``dirs``: directories searched first for the module's top-level module or package."""
    if not is_dotted(ref):
        raise ConfigError(f"{ref!r} is not a module:attribute reference")
    mod_name, _, attr = ref.partition(":")
    try:
        if dirs:
            _import_from(mod_name, dirs)
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        where = f" (looked in {', '.join(map(str, dirs))}, then the import path)" if dirs else ""
        raise ConfigError(f"{ref!r}: cannot import {mod_name}{where}: {exc}") from exc
    except Exception as exc:  # the user's module itself failed while it was imported
        raise ConfigError(f"{ref!r}: importing {mod_name} failed: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{ref!r}: {mod_name} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj


class Registry:
    """Names -> objects of one plug-in kind (``kind`` is used in messages)."""

    def __init__(
        self, kind: str, builtins: dict[str, str] | None = None, base: type | None = None, hint: str = "module:Class"
    ):
        self.kind = kind
        self.base = base
        self.hint = hint
        self._entries: dict[str, Any] = dict(builtins or {})

    def register(self, name: str, obj: Any = None) -> Callable | None:
        """Register ``obj`` (an object or a ``module:Attr`` string) under ``name``; without ``obj``,
        a decorator."""
        if obj is None:

            def deco(o):
                self.register(name, o)
                return o

            return deco
        if name in self._entries and self._entries[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = obj
        return None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries or is_dotted(name)

    def get(self, name: str, dirs: Sequence[str | Path] = ()) -> Any:
        """The object registered as ``name``, or the one ``name`` points at (``module:Attr``, its
        module looked up in ``dirs`` first: ``load_object``)."""
        if name in self._entries:
            obj = self._entries[name]
            if isinstance(obj, str):
                obj = self._entries[name] = load_object(obj)
        elif is_dotted(name):
            obj = load_object(name, dirs)
        else:
            raise ConfigError(f"unknown {self.kind} {name!r}; built-ins: {', '.join(self.names())}, or {self.hint}")
        if self.base is not None and not (isinstance(obj, type) and issubclass(obj, self.base)):
            raise ConfigError(f"{self.kind} {name!r} is not a subclass of {self.base.__module__}.{self.base.__name__}")
        return obj

    def build(self, name: str, config: Any, ctx: Any) -> Any:
        """``get(name)(config, ctx)``: the one constructor signature of every plug-in."""
        return self.get(name)(config, ctx)

    def build_callable(self, name: str, config: Any, base: type, wrap: Callable[[Callable, Any], Any]) -> Any:
        """For kinds whose plug-in is a ``base`` subclass or a plain function (losses, advantage
        estimators): ``cls(config)``, or ``wrap(function, config)``; ConfigError for anything else."""
        obj = self.get(name)
        if isinstance(obj, type) and issubclass(obj, base):
            return obj(config)
        if callable(obj) and not isinstance(obj, type):
            return wrap(obj, config)
        raise ConfigError(
            f"{self.kind} {name!r} is neither a subclass of {base.__module__}.{base.__name__} nor a function"
        )
