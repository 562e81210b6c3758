"""The coordinator's state dir and its one owner (state.py: every folder, checked for other users' write access):
the replan history (history.py), the launch manifests and this coordinator's identity (manifest.py), and the
heal supervisors' state files (healfile.py). docs/architecture.md, "Files each side writes"."""
