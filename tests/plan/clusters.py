"""Inventory texts and a writer for the planner tests."""

from pathlib import Path


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
