"""The coordinator's connector to its nodes: every side effect on a node (a command, a process, a file, a node
operation) goes through a NodeHandle (nodes.py) over a Transport: local (localnode.py), SSH (sshnode.py, the one
asyncssh user, with its options built in ssh_policy.py) or, in unit tests, scripted (faketransport.py)."""
