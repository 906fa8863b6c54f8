"""One layer's coded K/V as one argument (:class:`CodedKV`), and the flat op functions built from it.

The ops that read a compressed cache layer (``decode_attention`` and its kernels, ``cache_kv``)
take its eight tensors flat, in :class:`CodedKV`'s order, since a ``torch.library`` schema has no
bundles; their Python implementations take one :class:`CodedKV`. :func:`flat_op` turns such an
implementation into the function an op registers, whose signature (from which the schema is
inferred) spells the bundle out.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch


class CodedKV(NamedTuple):
    """One layer's coded K/V as the decode kernels read them (the flat order of the schema).

    ``k_codes``/``v_codes`` ``[B, Hkv, Tmax, W]`` uint8 stored codes; ``k_centroids``/
    ``v_centroids`` ``[E, d]`` float32; ``n_coded`` 0-d int (filled code slots); ``k_window``/
    ``v_window`` ``[B, Hkv, R, D]`` the full-precision window (``K~`` and ``V``); ``n_window`` 0-d
    int (filled window slots)."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_centroids: torch.Tensor
    v_centroids: torch.Tensor
    n_coded: torch.Tensor
    k_window: torch.Tensor
    v_window: torch.Tensor
    n_window: torch.Tensor


def bundle_coded_kv(args: tuple, first: int) -> tuple:
    """A flat op's arguments ``args`` as its implementation takes them: the eight tensors from
    position ``first`` on bundled into one :class:`CodedKV`."""
    end = first + len(CodedKV._fields)
    return (*args[:first], CodedKV(*args[first:end]), *args[end:])


def _parameters(annotated: dict[str, object]) -> list[inspect.Parameter]:
    return [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)
        for name, annotation in annotated.items()
    ]


def flat_op(impl: Callable, before: dict[str, object], after: dict[str, object], returns: object) -> Callable:
    """The op function of ``impl(*before, kv: CodedKV, *after)``: it takes the arguments
    ``before``, the eight fields of :class:`CodedKV` (tensors) and ``after`` flat (each dict maps
    a name to its annotation, in order), bundles the eight and calls ``impl``; its signature is
    the flat one, returning ``returns``, so ``torch.library`` infers the op's schema from it."""
    first = len(before)

    @functools.wraps(impl)
    def flat(*args):
        return impl(*bundle_coded_kv(args, first))

    coded = dict.fromkeys(CodedKV._fields, torch.Tensor)
    flat.__signature__ = inspect.Signature(_parameters({**before, **coded, **after}), return_annotation=returns)
    return flat
