"""What the coordinator and the nodes both read and write: the runtime-dir files (markers, cancel files, acks,
leases), the signed deployment and the rank contract, the rank spec, the model folder (weights, architectures,
content manifest) and the checks of a node's copy. Imports nothing of clusterctl but the base modules (errors,
atomic, names, locks)."""
