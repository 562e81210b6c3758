"""``python -m clusterctl.rank``: one rank (see ``runtime``)."""

from clusterctl.rank.runtime import main

raise SystemExit(main())
