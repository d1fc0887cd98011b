"""The model card of the shared W4A16 run (conftest's `w4a16_run`), replaced by a symlink: the
evaluation section is not written through it. The card's unit tests: tests/unit/test_model_card.py.
"""

from __future__ import annotations

from compressflow.reporting.model_card import CARD, add_evaluation


def test_a_symlinked_card_is_not_followed(w4a16_run, tmp_path):
    import shutil

    folder = tmp_path / "published"
    shutil.copytree(w4a16_run.published.path, folder)
    elsewhere = tmp_path / "elsewhere.md"
    elsewhere.write_text("not ours")
    (folder / CARD).unlink()
    (folder / CARD).symlink_to(elsewhere)
    assert not add_evaluation(folder, "section") and elsewhere.read_text() == "not ours"
