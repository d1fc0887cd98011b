"""Every error reads `<field>: <problem>. Fix: <fix>`, whichever class raises it."""

from __future__ import annotations

import inspect

import pytest

from compressflow import errors

ERROR_CLASSES = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, errors.CompressflowError)
]


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_class_names_field_problem_and_fix(cls):
    error = cls("recipe.recipe_args", "no value for $damp", "add damp to recipe_args")
    assert str(error) == "recipe.recipe_args: no value for $damp. Fix: add damp to recipe_args"
    assert (error.field, error.problem, error.fix) == (
        "recipe.recipe_args",
        "no value for $damp",
        "add damp to recipe_args",
    )
    with pytest.raises(TypeError):
        cls("a message without a field or a fix")
