"""What runs on a node besides the rank: programs the coordinator starts there over SSH (or locally).

``nodeops``  ``python -m clusterctl.node.nodeops session``: one process per node and command answering node
             operations (probe, spawn, sweep, markers, files, model copies) as JSON lines, each request parsed
             into its model (protocol/nodeops.py).
``keeper``   ``python -m clusterctl.node.keeper -- ARGV``: ties a long-lived process to the channel that started it.
``procs``    a process's identity checked (pid, start time, boot id, nonce) and the verified stop: TERM, grace, KILL.

The process ``Identity``, the boot id and start times live in protocol/identity.py: one copy for both sides.

These modules import only the standard library, psutil and the shared protocol modules (runtimefiles, atomic,
errors, sync.manifest): never the coordinator (tests/test_layers.py checks it).
"""
