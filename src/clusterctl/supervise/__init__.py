"""The heal supervisor (`clusterctl supervise`): a long-lived process of its own that watches a deployment's ranks
(watch.py), decides whom a loss blames and whether to heal (policy.py, pure), heals (heal.py) and rejoins
(rejoin.py) what it knows and writes as its state file (persist.py), in a loop (loop.py), run as a command with its
lock and signals (run.py). docs/heal.md."""
