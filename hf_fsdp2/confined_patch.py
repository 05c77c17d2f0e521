"""An attribute of another library replaced only while a trainer is being built, and only for the thread building it.

hf_fsdp2 replaces two functions of other libraries, each because the library decides something inside a
constructor with no argument or method to override (see the users: `loading.path_models`, `trl`). A
`ConfinedPatch` keeps that from being seen by anything else:
- the replacement is on the owner only while at least one thread is inside a `window` (counted under a lock, so
  two threads building trainers at once do not restore each other's);
- the replacement asks `current()` for the innermost window's context of the *calling thread*; a call from any
  other thread, or outside every window, goes to the original unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

Context = TypeVar("Context")


class ConfinedPatch(Generic[Context]):
    """`owner.name` replaced by `make(original)` while a thread holds a window; the replacement reads `current()`."""

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        self._owner, self._name, self._make = owner, name, make
        self._lock = threading.Lock()
        self._holders = 0
        self._original: Any = None
        self._local = threading.local()

    @contextlib.contextmanager
    def window(self, context: Context) -> Iterator[Context]:
        """Within the block, calls from this thread see `context` through `current()`."""
        with self._lock:
            if self._holders == 0:
                self._original = self._owner.__dict__[self._name]
                setattr(self._owner, self._name, self._make(self._original))
            self._holders += 1
        stack = self._stack()
        stack.append(context)
        try:
            yield context
        finally:
            stack.pop()
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    setattr(self._owner, self._name, self._original)

    def current(self) -> Context | None:
        """The calling thread's innermost window context, or None (then the original must run)."""
        stack = self._stack()
        return stack[-1] if stack else None

    def _stack(self) -> list[Context]:
        """This thread's open windows, innermost last."""
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack
