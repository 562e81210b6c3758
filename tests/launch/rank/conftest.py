"""The rank's tests share the launch tests' helpers (rankharness, launchutil) one folder up."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
