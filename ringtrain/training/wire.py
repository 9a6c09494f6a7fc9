"""What ranks send each other through ringtrain's own collectives: JSON, never a pickle.

Horovod's ``broadcast_object`` / ``allgather_object`` cloudpickle whatever they are given, and
every receiving rank unpickles it: whoever can write into a rank's Gloo or MPI connections (which
nothing authenticates) could run code there.  :class:`ringtrain.training.world.World` sends
:func:`encode`'s bytes instead, in a uint8 tensor, and :func:`decode` builds nothing but plain
data from them: ``None``, booleans, numbers (NaN and infinities included), text, lists and
mappings with text keys, and NumPy arrays of numbers or bytes (a tagged mapping:
``{"$array": [dtype, shape, base64 of the C-order bytes]}``).  Tuples arrive as lists.  Anything
else is a :class:`TypeError` on the sending side: a caller that needs more sends a plain form of
it (``FolderData.to_plain``).
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

ARRAY = "$array"
_KINDS = "biufS"  # bool, integers, floats, byte strings: what an array may hold


class WireError(ValueError):
    """Bytes from a peer that are not what :func:`encode` makes."""


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or ARRAY in value:
            raise TypeError(f"only mappings with text keys (not {ARRAY!r}) travel between ranks")
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _KINDS or value.dtype.fields is not None:
            raise TypeError(f"arrays of {value.dtype} do not travel between ranks")
        data = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode("ascii")
        return {ARRAY: [value.dtype.str, list(value.shape), data]}
    if isinstance(value, np.generic):
        return _plain(value.item())
    raise TypeError(f"{type(value).__name__} does not travel between ranks; send a plain form of it")


def encode(value: Any) -> bytes:
    return json.dumps(_plain(value), separators=(",", ":")).encode()


def _array(spec: Any) -> np.ndarray:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)
            and isinstance(spec[1], list) and isinstance(spec[2], str)):
        raise WireError("a malformed array")
    kind, shape, data = spec
    try:
        dtype = np.dtype(kind)
    except TypeError:
        raise WireError(f"an array of unknown type {kind[:20]!r}") from None
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.itemsize == 0:
        raise WireError(f"an array of type {dtype}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError("an array of a malformed shape")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise WireError("an array whose bytes are not base64") from None
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise WireError("an array whose bytes do not fill its shape")
    return np.frombuffer(raw, dtype).reshape(shape).copy()


def _hook(mapping: dict) -> Any:
    if ARRAY in mapping:
        if len(mapping) != 1:
            raise WireError("a malformed array")
        return _array(mapping[ARRAY])
    return mapping


def decode(data: bytes) -> Any:
    """The plain value :func:`encode` made ``data`` from; :class:`WireError` for anything else."""
    try:
        return json.loads(bytes(data).decode("utf-8"), object_hook=_hook)
    except WireError:
        raise
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError included
        raise WireError(f"not ringtrain's encoding ({type(err).__name__})") from None
