"""One reader of a model folder's weight files (modelfiles/folder.py) for the planner, the rank, the node's
preflight and the PLE reader: the index is optional, as for mlx-lm; when present it names plain files only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modelfiles import make_model  # noqa: E402

from clusterctl.errors import IntegrityError, MissingInput  # noqa: E402
from clusterctl.node.modelops import model_check  # noqa: E402
from clusterctl.ple.errors import CorruptTensorFile  # noqa: E402
from clusterctl.ple.safetensors import read_index  # noqa: E402
from clusterctl.modelfiles.folder import INDEX_NAME, weight_files  # noqa: E402


def _with_tokenizer(m: Path) -> Path:
    (m / "tokenizer.json").write_text("{}")
    return m


def test_the_index_names_the_files_and_without_it_every_safetensors_counts(tmp_path):
    m = _with_tokenizer(make_model(tmp_path / "m", layers=2, shards=2))
    named = [f.name for f in weight_files(m)]
    assert len(named) == 2 and model_check(str(m)).wire() == {"ok": True, "files": named}
    (m / INDEX_NAME).unlink()  # a single-file or unindexed model: mlx-lm loads every *.safetensors
    assert [f.name for f in weight_files(m)] == sorted(named)
    assert model_check(str(m)).ok


@pytest.mark.parametrize("target", ["../x.safetensors", "/etc/passwd", ".hidden", "", 7])
def test_an_index_that_points_outside_the_folder_is_refused_by_every_reader(tmp_path, target):
    m = _with_tokenizer(make_model(tmp_path / "m", layers=2))
    (m / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": target}}))
    with pytest.raises(IntegrityError, match="not a file of the folder"):
        weight_files(m)
    with pytest.raises(CorruptTensorFile):
        read_index(m / INDEX_NAME)
    got = model_check(str(m))
    assert not got.ok and "not a file of the folder" in got.error


def test_a_missing_folder_of_weights_is_one_clear_error(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(MissingInput, match="no \\*.safetensors"):
        weight_files(tmp_path / "m")
    (tmp_path / "m" / INDEX_NAME).mkdir()
    with pytest.raises(IntegrityError, match="not a regular file"):
        weight_files(tmp_path / "m")
