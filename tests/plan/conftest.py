import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modelfiles import make_model  # noqa: E402


@pytest.fixture
def model32(tmp_path):
    return make_model(tmp_path / "m32", layers=32, hidden=64)


@pytest.fixture
def state(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("CLUSTERCTL_STATE_DIR", str(d))
    return d


def write_cluster(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


THREE = """
[cluster]
name = "lab"
[[node]]
name = "a"
memory_gb = 64
[[node]]
name = "b"
host = "10.0.0.2"
ips = ["10.0.0.2", "fe80::1%en10"]
memory_gb = 128
model_path = "/models/m"
[[node]]
name = "c"
host = "10.0.0.3"
memory_gb = 192
model_path = "/models/m"
"""
