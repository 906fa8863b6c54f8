"""The registered codecs, by the name a codebook file stores (:mod:`.base`'s interface).

Adding a codec: a package under ``vecinfer_compile/codecs/`` with a :class:`~.base.Codec`
subclass, and one line in :data:`_PACKAGES`. Packages import on first use, so that the file format,
the command line and ``import vecinfer_compile`` stay light.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Codec

DEFAULT = "codebooks"
_PACKAGES = {
    "codebooks": "vecinfer_compile.codecs.codebooks",
    "trellis": "vecinfer_compile.codecs.trellis",
}
_loaded: dict[str, Codec] = {}


_extra: dict[str, Codec] = {}


def names() -> tuple[str, ...]:
    """Every registered codec's name, the default first."""
    return (*_PACKAGES, *_extra)


def get(name: str) -> Codec:
    """The codec named ``name``; a ValueError naming the registered ones for any other."""
    if name in _extra:
        return _extra[name]
    if name not in _PACKAGES:
        raise ValueError(f"unknown codec {name!r}: this version has {', '.join(names())}")
    if name not in _loaded:
        _loaded[name] = importlib.import_module(_PACKAGES[name]).CODEC
    return _loaded[name]


def all_codecs() -> list[Codec]:
    return [get(name) for name in names()]


@contextlib.contextmanager
def extra(name: str, codec: Codec):
    """``codec`` registered as ``name`` within the block (a codec outside the package: tests)."""
    if name in names():
        raise ValueError(f"a codec named {name!r} is registered already")
    _extra[name] = codec
    try:
        yield codec
    finally:
        del _extra[name]


def of(code) -> Codec:
    """The codec whose side code ``code`` is (by its type)."""
    for codec in all_codecs():
        if isinstance(code, codec.code_type):
            return codec
    raise TypeError(f"{type(code).__name__} is no registered codec's side code ({', '.join(_PACKAGES)})")
