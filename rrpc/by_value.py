"""Code pickled by value (cloudpickle), made affordable: its one slow lookup remembered.

For every function it pickles by value (a lambda, a closure, a function of a
``__main__`` the receiver does not run), cloudpickle finds the submodules the
function's code may name by reading the name of every loaded module: ~1,200
with torch, ~2.5 ms a call here, which made such a call 10x slower than one
naming its function. The answer depends only on the code object, the modules
it names and what is loaded, so ``remember_submodules`` keeps it per code
object and asks again when a module is loaded or unloaded (a change of
``len(sys.modules)``). What is pickled is unchanged: the function's globals
and closure are read afresh at every call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import cloudpickle

_LIMIT = 1024  # remembered answers; all are dropped past it (code objects are kept alive)


def _remembered(find: Callable[[Any, Any], list]) -> Callable[[Any, Any], list]:
    cache: dict[tuple, list] = {}

    def find_remembered(code: Any, dependencies: Any) -> list:
        key = (code, tuple(map(id, dependencies)), len(sys.modules))
        found = cache.get(key)
        if found is None:
            if len(cache) >= _LIMIT:
                cache.clear()
            found = cache[key] = find(code, dependencies)
        return list(found)

    find_remembered.remembers = find  # type: ignore[attr-defined]
    return find_remembered


def remember_submodules() -> None:
    """Make cloudpickle remember ``_find_imported_submodules`` (once; a
    cloudpickle without that function is left as it is)."""
    module: Any = getattr(cloudpickle, "cloudpickle", None)
    find = getattr(module, "_find_imported_submodules", None)
    if find is not None and not hasattr(find, "remembers"):
        module._find_imported_submodules = _remembered(find)
