"""The front door (`clusterctl front`): a long-lived process of its own that keeps one stable address in front of
the cluster's current rank 0 (proxy.py, over aiohttp's server, listener.py, and client, upstream.py), follows
the job that serves (follow.py), keeps its records in the state dir (records.py) and checks who may call
(apikey.py). docs/front.md."""
