"""Placeholder CLI entry; the real Typer app replaces this."""


def main() -> None:  # pragma: no cover
    raise SystemExit("clusterctl: CLI under construction")
