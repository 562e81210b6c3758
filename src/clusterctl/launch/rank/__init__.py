"""The node side of a deployment: what runs inside each rank process, on its node.

``python -m clusterctl.launch.rank --contract FILE --node NAME`` (``__main__`` -> ``runtime.main``) is started by
the coordinator through the keeper (``launch/keeper.py``) or detached by a node operation (``launch/nodeops.py``).
Here: the rank's life and exits (``runtime``), the pipeline step loop and generation (``pipeline``), the step
loop every rank runs (``steploop``) on its meeting schedule (``schedule``), the requests rank 0's HTTP threads
hand it (``jobs``), rank 0's OpenAI-compatible HTTP API (``api``) and its request parsing (``openai``), the
SSD-backed embedding (``offload``), the rank's own watchdogs: launcher lease, keeper, stuck collectives
(``watchdog``), and the peer-loss ladder (``peerprobe``).

Everything else in ``clusterctl.launch`` runs on the coordinator (transport, sshnode, nodes, supervisor,
teardown, reaper, status, cancel, quiescence, manifest, hostfile, ssh_policy), except three small programs the
coordinator runs ON nodes: ``keeper``, ``nodeops`` (with ``procs``). The formats both sides read and write live
beside them: ``rankspec`` and ``contract`` (what a rank is told, signed), ``markers`` (what a rank reports),
``cancelfile`` (cancel requests and their acks). Nothing in this package imports the coordinator's modules.
"""
