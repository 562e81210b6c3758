"""Moved to ``clusterctl.node.keeper``; this name stays for the rank's watchdog, which imports PID_ENV from here."""

from clusterctl.node.keeper import PID_ENV  # noqa: F401
