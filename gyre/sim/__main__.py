"""`python -m gyre.sim [hydra overrides]`: the cluster simulator app (see `gyre.sim.app`)."""

from gyre.sim.app import main

if __name__ == "__main__":
    main()
