"""Shared fixtures for the whole suite. The real-sshd and network-namespace fixtures live in fixtures_ssh.py."""

from fixtures_ssh import netns_cluster, sshd, sshd_factory  # noqa: F401  (fixtures, registered by import)
