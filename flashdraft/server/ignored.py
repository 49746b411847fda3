"""Request fields that are accepted and ignored, named once in the server's log.

Coding agents send fields written for a hosted model (``output_config.effort``,
``context_management``, ``client_metadata``...) with every request. Refusing them stops the
agent at its first request; accepting them silently hides that they do nothing here. So
each such field is named in one warning the first time an API receives it, and never again
for that API while the server runs (an agent's every turn would otherwise repeat it).
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable

log = logging.getLogger("flashdraft.server")

_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def note_ignored(api: str, names: Iterable[str], why: str = "they change nothing for a local model") -> None:
    """Log the fields of ``names`` this API has not yet been sent, in one warning.

    Args:
        api: the route's API (``messages``, ``responses``, ``chat``...).
        names: the ignored fields, dotted where nested (``output_config.effort``).
        why: the reason, said once in the warning.
    """
    with _lock:
        new = sorted({n for n in names if (api, n) not in _seen})
        _seen.update((api, n) for n in new)
    if new:
        log.warning("%s: accepted and ignored (%s; named once): %s", api, why, ", ".join(new))


def forget() -> None:
    """Clear what has been named (for tests: each starts as a fresh server)."""
    with _lock:
        _seen.clear()
