"""`python -m gyre.train [hydra overrides]`: the training program (see `gyre.runtime.app`, docs/runtime.md)."""

from gyre.runtime.app import main

if __name__ == "__main__":
    main()
