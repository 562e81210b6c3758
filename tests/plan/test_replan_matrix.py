"""The replan option matrix with a fixed seed (tests/replanfuzz.py says what each step checks; bench/faults.py
walks it with a random seed)."""

import random

import pytest

from replanfuzz import model_folder, walk

pytestmark = pytest.mark.slow  # walks every replan option combination (minutes)

# A seed whose 60 steps (about 8 s) reach every outcome below, and that fails on the bug of issue 30 both as it
# was (the id from plan_hash: plan --prompt-cache-gb 0 and the default share an id) and with the options added
# to that hash (a --path-map change is then "unchanged"); checked by swapping deployment.identity_doc.
SEED = 47


def test_the_replan_option_matrix(tmp_path):
    notes = walk(tmp_path, model_folder(tmp_path / "m"), random.Random(SEED), steps=60)
    # the walk must reach every kind of outcome, or it checks less than it says: changes, no-ops, --to, the
    # records-only update (measured speeds), a bad option (2), a missing model folder (69), a plan that does not
    # fit or is invalid (78)
    kinds = {n.split()[0] for n in notes} | {n for n in notes if n.startswith("refused")}
    assert {"applied", "unchanged", "back", "records", "refused 2", "refused 69", "refused 78"} <= kinds, notes


@pytest.mark.parametrize("identity, broken", [
    (lambda dep: {"plan_hash": dep.plan_hash}, "names two different deployments"),  # the id before issue 30
    (lambda dep: {"plan_hash": dep.plan_hash, "options": dep.options.model_dump(mode="json")}, "unchanged, but"),
])
def test_the_walk_fails_on_the_identity_of_issue_30(tmp_path, monkeypatch, identity, broken):
    """The walk is a test that can fail: with the deployment id hashing less than what runs, it stops."""
    from clusterctl.protocol import deployment

    monkeypatch.setattr(deployment, "identity_doc", identity)
    with pytest.raises(AssertionError, match=broken):
        walk(tmp_path, model_folder(tmp_path / "m"), random.Random(SEED), steps=60)
