"""The rank process: what runs inside each rank, on its node.

``python -m clusterctl.rank --contract FILE --node NAME`` (``__main__`` -> ``runtime.main``) is started by the
coordinator through the node keeper (``node/keeper.py``) or detached by a node operation (``node/nodeops.py``).
Here: the rank's life and exits (``runtime``), loading this rank's layers (``loading``), the group and its
control collectives (``group``), what one request is to the ranks (``generation``), the model's forward pass
(``stage``), the step loop every rank runs (``steploop``) on its meeting schedule (``schedule``), the requests
rank 0's HTTP threads hand it (``requestqueue``), rank 0's OpenAI-compatible HTTP API (``api``, ``routes``,
``handler``, ``wire``, ``openai``, ``respond``), the SSD-backed embedding (``offload``), the rank's own watchdogs:
launcher lease, keeper, stuck collectives (``watchdog``), and the peer-loss ladder (``peerprobe``).

What a rank is told and what it reports are files both sides read and write: ``clusterctl.shared`` (rankspec,
contract, markers, cancelfile, runtimefiles). Nothing in this package imports the coordinator (tests/test_layers.py).
"""
