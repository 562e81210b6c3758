"""``python -m clusterctl.launch.rank``: one rank (see ``runtime``)."""

from clusterctl.launch.rank.runtime import main

raise SystemExit(main())
