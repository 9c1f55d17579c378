"""dwconv's environment switches, parsed the one way everywhere; and files it shares with other
processes, written whole."""

from __future__ import annotations

import os
import threading
from typing import Optional

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")
_PARSED: dict = {None: None}
_UNPARSED = object()


def switch(name: str) -> Optional[bool]:
    """The environment variable `name` as a switch: True for 1/true/on/yes, False for 0/false/off/no
    (any case, spaces ignored), None when unset or empty. Anything else raises: a typo must not turn
    a path on or off unseen."""
    value = os.environ.get(name)
    parsed = _PARSED.get(value, _UNPARSED)  # (read on every eager call: parsed once a spelling)
    if parsed is not _UNPARSED:
        return parsed
    if value is None or not value.strip():
        return None
    word = value.strip().lower()
    if word in _ON or word in _OFF:
        _PARSED[value] = word in _ON
        return _PARSED[value]
    raise ValueError(f"dwconv: environment variable {name}={value!r} is not a switch; "
                     f"use one of {'/'.join(_ON)} or {'/'.join(_OFF)}")


_INTERPRET: Optional[bool] = None


def triton_interpreter_enabled() -> bool:
    """True when Triton runs kernels on CPU tensors: TRITON_INTERPRET=1, read from the environment
    as Triton reads it (importing Triton or torch._dynamo here would fix its mode before a caller
    such as the no-GPU demo sets the variable), once, so that torch.compile traces a constant."""
    global _INTERPRET
    if _INTERPRET is None:
        _INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return _INTERPRET


def write_whole(path: str, text: str) -> None:
    """Writes path as one step for its readers (another process may read it now): all of text or
    the file as it was. Raises OSError as open does."""
    partial = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)
