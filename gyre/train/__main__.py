"""`python -m gyre.train [hydra overrides]`: the training program (see `gyre.train.app`, docs/runtime.md)."""

from gyre.train.app import main

if __name__ == "__main__":
    main()
