"""What runs on a node besides the rank: programs the coordinator starts there over SSH (or locally).

``nodeops``  ``python -m clusterctl.node.nodeops session``: one process per node and command answering node
             operations (probe, spawn, sweep, markers, files, model copies) as JSON lines.
``keeper``   ``python -m clusterctl.node.keeper -- ARGV``: ties a long-lived process to the channel that started it.
``procs``    process identity (pid, start time, boot id, nonce) and the verified stop: TERM, grace, KILL.
``identity`` the boot id and process start times, one copy for both sides of the wire.

These modules import only the standard library, psutil and the shared protocol modules (runtimefiles, atomic,
errors, sync.manifest): never the coordinator (tests/test_layers.py checks it).
"""
