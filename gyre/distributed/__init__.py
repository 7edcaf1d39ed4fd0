"""Process groups of cells and prefixes, and weight transport from the core (docs/architecture.md, process model).

`layout` is pure (stdlib); `groups` and `transport` need torch.distributed. See docs/distributed.md.
"""

from gyre.distributed.layout import GroupSpec, Layout

__all__ = ["GroupSpec", "Layout"]
