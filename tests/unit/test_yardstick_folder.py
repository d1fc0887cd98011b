"""The yardstick's folder: a build writes only over what an earlier build wrote there."""

from __future__ import annotations

import pytest

from compressflow.demo.yardstick import (
    BUILDING,
    MODEL_DIR,
    MOE_MODEL_DIR,
    MOE_SPEC,
    SPEC_FILE,
    YardstickSpec,
    build_yardstick,
)


def test_a_folder_with_files_no_build_wrote_is_refused_and_left_as_it_was(tmp_path):
    # A rebuild drops the old build's marker and writes over its files: only once it is sure
    # they are a build's. Refused before any training starts.
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        build_yardstick(tmp_path)
    (tmp_path / "notes.txt").unlink()
    marker = tmp_path / MODEL_DIR / SPEC_FILE
    marker.parent.mkdir()
    marker.write_text("a file of the user's, under the build's name")
    with pytest.raises(FileExistsError, match="not written by a yardstick build"):
        build_yardstick(tmp_path)
    assert marker.read_text() == "a file of the user's, under the build's name"


@pytest.mark.parametrize(
    ("spec", "model_dir"), [(YardstickSpec(), MODEL_DIR), (MOE_SPEC, MOE_MODEL_DIR)]
)
def test_a_model_folder_no_build_started_is_refused_and_left_as_it_was(tmp_path, spec, model_dir):
    """Only the build's own folder name (`yardstick-llama/`, or `yardstick-mixtral/` for the MoE
    yardstick), but a user's weights in it and no marker: neither a finished build nor a crashed
    one (which leaves BUILDING) wrote it."""
    assert spec.model_dir == model_dir
    weights = tmp_path / model_dir / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"the user's weights")
    with pytest.raises(FileExistsError, match="not written by a yardstick build"):
        build_yardstick(tmp_path, spec)
    assert weights.read_bytes() == b"the user's weights"
    assert not (tmp_path / model_dir / BUILDING).exists()
