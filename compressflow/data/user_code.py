"""Imports user code named as `module:function`: the only way compressflow runs user code.

Loaders and collators are never serialized source to `exec`; they are importable functions on
the worker, named in a parameter. Since anyone who can start a deployment sets parameters, a
user-named module must sit under a prefix that the deployment allows in
`COMPRESSFLOW_ALLOWED_IMPORTS` (comma-separated, e.g. `mycompany.loaders,team_data`). Every
failure names the parameter and the fix.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from compressflow.errors import InputError
from compressflow.settings import settings

ALLOWED_IMPORTS_ENV = "COMPRESSFLOW_ALLOWED_IMPORTS"


def allowed_prefixes() -> list[str]:
    return settings().allowed_import_prefixes()


def is_allowed(module_name: str) -> bool:
    """Prefixes match whole dotted components: `team` allows `team.x`, not `teammate`."""
    return any(
        module_name == prefix or module_name.startswith(prefix + ".")
        for prefix in allowed_prefixes()
    )


def import_callable(
    spec: str,
    field: str,
    error: type[InputError] = InputError,
    call_with: tuple = (),
    trusted: bool = False,
) -> Callable:
    """`module:function` to the function, checked to accept `call_with` as its arguments.

    `trusted` is for compressflow's own registry entries, which skip the allow-list.
    """
    module_name, _, function_name = spec.partition(":")
    if not trusted and not is_allowed(module_name):
        raise error(
            field,
            f"module '{module_name}' of '{spec}' is not in the allow-list "
            f"{ALLOWED_IMPORTS_ENV}={','.join(allowed_prefixes()) or '(empty)'}",
            f"have the deployment (or your environment) add '{module_name}' or a parent package "
            f"to {ALLOWED_IMPORTS_ENV}",
        )
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
    try:
        inspect.signature(function).bind(*call_with)
    except TypeError as exc:
        raise error(
            field,
            f"'{spec}' cannot be called with {len(call_with)} argument(s): {exc}",
            f"give it the signature {function_name}({', '.join(f'arg{i}' for i in range(len(call_with)))})",
        ) from exc
    except ValueError:  # builtins without a signature: let the call itself decide
        pass
    return function
