"""The wire protocol between the coordinator and the nodes: what both sides read and write. The runtime-dir files
(markers, cancel files, acks, leases: runtimefiles.py), the signed deployment (deployment.py, signing.py), a node as
the cluster file describes it (nodespec.py), what a rank is told (rankspec.py) and the signed contract that carries
it (contract.py), the chat-template sandbox both sides run (chattemplate.py), process identity (identity.py), the
versions a node's probe reports and preflight compares (versions.py).
Imports nothing of clusterctl but the base modules (errors, atomic, names, locks)."""
