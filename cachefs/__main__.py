"""``python -m cachefs`` runs the command line."""

from cachefs.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
