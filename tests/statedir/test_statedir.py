"""The state dir's one owner (statedir/state.py) and its replan history (statedir/history.py), without a rank or a
node: every folder it keeps is checked for another user's write access, and the history is read strictly and
written whole."""

from __future__ import annotations

import os

import pytest

from clusterctl.errors import ConfigError, IntegrityError
from clusterctl.statedir import history
from clusterctl.statedir.state import FOLDERS, StateDir


def _state(tmp_path) -> StateDir:
    root = tmp_path / "state"
    root.mkdir(mode=0o700)
    for d in FOLDERS:
        (root / d).mkdir(mode=0o700)
    return StateDir(root)


def test_a_private_state_dir_with_every_folder_is_accepted(tmp_path):
    state = _state(tmp_path)
    assert state.check_safe() is state


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_folder_another_user_could_write_into_is_refused(tmp_path, folder):
    """heal/, fronts/ and reports/ too: a supervisor's state, a front's record or a fault report planted there
    would be acted on like the operator's own."""
    state = _state(tmp_path)
    (state.root / folder).chmod(0o777)
    with pytest.raises(ConfigError, match=f"{folder}.*other users may write into it"):
        state.check_safe()


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_folder_that_is_a_symlink_is_refused(tmp_path, folder):
    state = _state(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (state.root / folder).rmdir()
    (state.root / folder).symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="is a symlink"):
        state.check_safe()


def test_the_history_is_appended_whole_and_names_the_current_deployment(tmp_path):
    state = _state(tmp_path)
    assert history.entries(state, "lab") == [] and history.current(state, "lab") is None
    history.append(state, "lab", {"from": "d-1", "to": "d-2", "changes": ["ranks"]})
    history.append(state, "lab", {"from": "d-2", "to": "d-3", "changes": [], "kind": "heal"})
    assert [e["to"] for e in history.entries(state, "lab")] == ["d-2", "d-3"]
    assert history.current(state, "lab") == "d-3"
    assert history.clusters_of(state, None) == ["lab"]
    assert sorted(os.listdir(state.root / "history")) == ["lab.json"]  # no temp file left behind


@pytest.mark.parametrize("text", [
    '{"cluster": "other", "entries": []}',  # another cluster's history under this name
    '{"cluster": "lab", "entries": [{"from": "d-1"}]}',  # an entry that names no deployment
    '{"cluster": "lab", "entries": ',  # cut short
])
def test_a_history_that_is_not_this_clusters_is_refused_not_overwritten(tmp_path, text):
    state = _state(tmp_path)
    path = history.path_of(state, "lab")
    path.write_text(text)
    with pytest.raises(IntegrityError, match="move the file aside|replan history"):
        history.append(state, "lab", {"from": "d-1", "to": "d-2", "changes": []})
    assert path.read_text() == text
