"""Imports user code named as `module:function`: the only way compressflow runs user code.

Loaders and collators are never serialized source to `exec`; they are importable functions on
the worker, named in a parameter, and every failure names the parameter and the fix.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from tasks.errors import InputError


def import_callable(spec: str, field: str, error: type[InputError] = InputError) -> Callable:
    """`module:function` to the function; `error(field, ...)` when it cannot be imported."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(
            field,
            f"cannot import module '{module_name}' of '{spec}': {exc}",
            "install the module in the worker's environment or fix the name",
        ) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        what = "does not exist" if function is None else f"is of type {type(function).__name__}"
        raise error(
            field,
            f"'{function_name}' in '{module_name}' {what}, not a callable function",
            f"point {field.rsplit('.', 1)[-1]} at a function defined in {module_name}",
        )
    return function
