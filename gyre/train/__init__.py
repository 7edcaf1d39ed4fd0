"""`python -m gyre.train`: the training app (`gyre.train.app`), above the runtime (`gyre.runtime`) and the recipes
(`gyre.recipes`) it picks from. The trainers themselves are `gyre.trainer`. Importing this package imports no torch:
a config mistake is reported before torch loads (docs/runtime.md, "The program")."""
