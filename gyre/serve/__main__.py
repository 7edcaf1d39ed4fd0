"""`python -m gyre.serve [hydra overrides]`: proxy + embedded engine, recording every call (see gyre.serve.app)."""

from gyre.serve.app import main

if __name__ == "__main__":
    main()
