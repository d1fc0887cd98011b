"""The folder checks are a registry: a check registered there runs wherever a model folder is
checked (fetch, the flow's precheck), in order, after the checks before it have handed on what
they read; none is named in flows/ or tasks/."""

from __future__ import annotations

import pytest

from compressflow.errors import ModelFetchError
from compressflow.flows.checks import precheck
from compressflow.inputs import RunArgs
from compressflow.model.folder_checks import Folder, FolderCheck, registry
from compressflow.params import DatasetArgs, ModelArgs, OutputArgs, RecipeArgs
from compressflow.tasks.fetch_model import fetch


def refuse_llamas(folder: Folder) -> None:
    """A stand-in check that reads what the config check handed on."""
    if folder.config.get("model_type") == "llama":
        raise ModelFetchError("model.model_id", "a dummy check refuses llamas", "use another")


@pytest.fixture()
def dummy(monkeypatch) -> FolderCheck:
    check = FolderCheck("dummy", "model.model_id", refuse_llamas)
    monkeypatch.setattr(registry, "FOLDER_CHECKS", (*registry.FOLDER_CHECKS, check))
    return check


def test_a_registered_check_runs_where_fetch_checks_a_folder(tiny_model, dummy):
    with pytest.raises(ModelFetchError, match="a dummy check refuses llamas") as raised:
        fetch(ModelArgs(model_id=str(tiny_model)))
    assert raised.value.field == dummy.field


def test_a_registered_check_runs_in_the_flows_precheck(tiny_model, dummy, tmp_path):
    args = RunArgs(
        model=ModelArgs(model_id=str(tiny_model)),
        dataset=DatasetArgs(dataset_name="python_docs", text_samples=8, max_seq_len=64),
        recipe=RecipeArgs(recipe="W4A16"),
        output=OutputArgs(save_directory=str(tmp_path / "out")),
    )
    with pytest.raises(ModelFetchError, match="a dummy check refuses llamas"):
        precheck(args)
    assert not (tmp_path / "out").exists()


def test_a_check_of_the_weight_files_waits_for_them(tiny_model, monkeypatch):
    ran = []
    check = FolderCheck("dummy", "model.model_id", ran.append, weights=True)
    monkeypatch.setattr(registry, "FOLDER_CHECKS", (*registry.FOLDER_CHECKS, check))
    config = registry.check_folder(tiny_model, ModelArgs(model_id=str(tiny_model)), weights=False)
    assert not ran and config["model_type"] == "llama"
    registry.check_folder(tiny_model, ModelArgs(model_id=str(tiny_model)))
    assert [folder.path for folder in ran] == [tiny_model]


def test_each_check_has_its_own_name_and_blames_a_model_field():
    names = [check.name for check in registry.FOLDER_CHECKS]
    assert len(names) == len(set(names))
    for check in registry.FOLDER_CHECKS:
        group, name = check.field.split(".")
        assert group == "model" and name in ModelArgs.model_fields, check
