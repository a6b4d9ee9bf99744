"""`python -m ferrox serve ...`: the same as the `ferrox` console script."""

from ferrox.entrypoints.cli import main

if __name__ == "__main__":
    main()
