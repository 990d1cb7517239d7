"""Objects named by import path in params (``"mypkg.rewards:exact_answer"``), resolved with errors that say what
to fix. No torch, no Hugging Face: params validation resolves them before any work."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def import_object(path: str) -> Any:
    """The object at ``"module.path:attribute"`` (the attribute may be dotted: ``"pkg.mod:Class.method"``).

    The module is imported from the Python path or, failing that, from the current working directory (the project
    folder `llm-train` and DVC run in), so a module kept beside params.yaml works without installing it.

    Args:
        path: ``"<module>:<attribute>"``.

    Returns:
        The attribute's value.

    Raises:
        ValueError: `path` is not of that form, the module cannot be imported (its own import error is named), or
            it has no such attribute; each message says what to fix.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{path!r} is not an import path; write 'module.path:function'")
    module = _import_module(module_name)
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{path!r}: module {module_name} ({module.__file__}) has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


def _import_module(name: str):
    cwd = os.getcwd()
    try:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if not _is_missing(err, name) or cwd in sys.path:
                raise
            sys.path.append(cwd)  # the project folder, last: an installed module of the same name wins
            return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if _is_missing(err, name):
            raise ValueError(
                f"no module named {name}: neither on the Python path nor in {cwd}; install it or put it there"
            ) from None
        raise ValueError(f"importing {name} failed: {type(err).__name__}: {err}") from None
    except Exception as err:  # noqa: BLE001 (the user's module failing in any way: named, without a traceback)
        raise ValueError(f"importing {name} failed: {type(err).__name__}: {err}") from None


def _is_missing(err: ModuleNotFoundError, name: str) -> bool:
    """Whether `err` says `name` itself (or a package above it) is missing, not something it imports."""
    return err.name is not None and (name == err.name or name.startswith(err.name + "."))
