"""The replan option matrix with a fixed seed (tests/replanfuzz.py says what each step checks; bench/faults.py
walks it with a random seed)."""

import random

from replanfuzz import model_folder, walk

SEED = 30


def test_the_replan_option_matrix(tmp_path):
    notes = walk(tmp_path, model_folder(tmp_path / "m"), random.Random(SEED), steps=40)
    # the walk must reach every kind of outcome, or it checks less than it says
    kinds = {n.split()[0] for n in notes}
    assert {"applied", "unchanged", "refused", "back"} <= kinds, notes
    assert any("69" in n for n in notes) and any("78" in n for n in notes), notes
