"""The user's own code, named ``package.module:function`` (``--model``, ``--data``): imported and
called on every rank, every failure one line that names the flag and what went wrong."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

from ringtrain.errors import UserError

SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")  # package.module:function


def import_function(flag: str, spec: str, what: str) -> Callable[..., Any]:
    """Import ``package.module`` and return its ``function``; ``what`` says what the function
    should do (for the message when it is not callable)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"{flag} {spec}: cannot import {module_name} ({err}); put its package on "
                        f"PYTHONPATH (every host, every rank) or install it") from None
    except Exception as err:  # the user's module raised while importing
        raise UserError(f"{flag} {spec}: importing {module_name} failed: "
                        f"{type(err).__name__}: {one_line(err)}") from None
    if not hasattr(module, attr):
        raise UserError(f"{flag} {spec}: {module_name} has no attribute {attr!r}")
    function = getattr(module, attr)
    if not callable(function):
        raise UserError(f"{flag} {spec}: {module_name}.{attr} is a {type(function).__name__}, "
                        f"not a function that {what}")
    return function


def accepted(function: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``offered`` that ``function`` names.  A function that takes
    ``**kwargs`` gets them all (:func:`call` drops the ones it then refuses)."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: offer everything
        return dict(offered)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(offered)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in named}


_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


def call(flag: str, spec: str, function: Callable[..., Any], offered: dict[str, Any]) -> Any:
    """``function(**kwargs)`` with only the keyword arguments it accepts.

    A builder that takes ``**kwargs`` and hands them on, as torchvision's do
    (``resnet18(**kwargs)`` -> ``ResNet(num_classes=...)``), refuses an argument only when called:
    the refused one is dropped and the call made again.  Python refuses an unexpected keyword
    before the function's body runs, so nothing of the first call has happened.
    """
    kwargs = accepted(function, offered)
    while True:
        try:
            return function(**kwargs)
        except TypeError as err:
            m = _UNEXPECTED.search(str(err))
            if m and m.group(1) in kwargs:
                del kwargs[m.group(1)]
                continue
            # A required parameter ringtrain does not fill: show all it offers.
            raise UserError(_failed(flag, spec, offered if "required" in str(err) else kwargs,
                                    err)) from None
        except Exception as err:
            raise UserError(_failed(flag, spec, kwargs, err)) from None


def _failed(flag: str, spec: str, kwargs: dict[str, Any], err: BaseException) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return (f"{flag} {spec}: calling it as {spec.partition(':')[2]}({shown}) failed: "
            f"{type(err).__name__}: {one_line(err)}")


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:197] + "..."
