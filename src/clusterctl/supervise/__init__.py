"""The heal supervisor (`clusterctl supervise`): a long-lived process of its own that watches a deployment's ranks
(watch.py), decides whom a loss blames and whether to heal (policy.py, pure), heals and rejoins (loop.py), and runs
as a command with its lock and signals (run.py). docs/heal.md."""
