"""``python -m cachefs`` runs the command line."""

from cachefs.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
