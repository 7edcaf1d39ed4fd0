"""Process groups of cells and prefixes, and weight transport from the core (docs/architecture.md, process model).

`layout` is pure (stdlib); `groups`, the transports (`transport`, `transport_torch`, `transport_mooncake`, `one_sided`,
`transport_store`), the micro-step claims (`claims`) and the controller's pump (`step_pump`) need torch.distributed.
See docs/distributed.md.
"""

from gyre.distributed.layout import GroupSpec, Layout

__all__ = ["GroupSpec", "Layout"]
