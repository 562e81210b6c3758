"""The rank process: what runs inside each rank, on its node.

``python -m clusterctl.rank --contract FILE --node NAME`` (``__main__`` -> ``runtime.main``) is started by the
coordinator through the node keeper (``node/keeper.py``) or detached by a node operation (``node/nodeops.py``).
Here, at the top: the rank's life and exits (``runtime``), joining the ring (``ringjoin``), its own watchdogs:
launcher lease, keeper, stuck collectives (``watchdog``), the peer-loss ladder (``peerprobe``), the compute threads'
priority (``priority``), its marker and cancel-file writers and watchers (``markers``, ``cancelfile``), what it
counts (``metrics``) and n choices of one request (``choices``). What every rank runs is ``engine/`` (the step loop,
its schedules, the model's forward pass, sampling, the caches); rank 0's OpenAI-compatible HTTP API is ``api/``.

What a rank is told and what it reports are files both sides read and write: ``clusterctl.protocol`` (rankspec,
contract, runtimefiles). Nothing in this package imports the coordinator (tests/test_layers.py).
"""
