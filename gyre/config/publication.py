"""Config of the core's publications: the weight stream to the engines and the policy directory (docs/runtime.md,
"Publication"). Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require_int

__all__ = ["PublicationConfig"]


@dataclass(kw_only=True)
class PublicationConfig:
    """How the core's weights reach the engines after a burst, and how often they are written as the policy."""

    bucket_mib: int = 512
    """Size of one bucket of the weight stream, in MiB: a publication moves the weights in buckets of whole tensors
    at most this big (a tensor bigger than a bucket travels alone); a core rank holds at most two of them at once
    beside its own shards."""
    policy_every: int = 1
    """Write the published weights as `<run dir>/policy` every this many publications, after the engines have them,
    in the background; 0: only the run's last policy."""
    policy_keep: int = 2
    """Policy versions kept under `<run dir>/policies/` (the oldest are removed once a newer one is complete); >= 1."""

    def __post_init__(self) -> None:
        require_int("publication.bucket_mib", self.bucket_mib, ge=1)
        require_int("publication.policy_every", self.policy_every, ge=0)
        require_int("publication.policy_keep", self.policy_keep, ge=1)

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mib << 20
