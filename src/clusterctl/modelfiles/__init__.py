"""A model on disk, read the same way by the coordinator and the nodes: the folder and its weight files, headers
and config (folder.py), what mlx-lm's architectures need (archs.py), the content manifest (manifest.py), a node's
copy checked (copycheck.py), and the tiny random-weight models the tests and `model tiny` build (tiny.py)."""
