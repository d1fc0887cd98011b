"""The yardstick's folder: a build writes only over what an earlier build wrote there."""

from __future__ import annotations

import pytest

from compressflow.demo.yardstick import MODEL_DIR, SPEC_FILE, build_yardstick


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
