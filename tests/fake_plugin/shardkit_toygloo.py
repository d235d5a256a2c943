"""A third-party backend in one file: gloo on the host under another name, required members only."""

import torch

from shardkit import Backend, hookimpl


class ToyGlooBackend(Backend):
    """Everything beyond the required members (and max_local_ranks: ranks share the host) comes from shardkit's defaults."""

    name = "toygloo"
    device_type = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        """Runs wherever torch has gloo."""
        import torch.distributed as dist

        return dist.is_available() and dist.is_gloo_available()

    @classmethod
    def requirement_hint(cls) -> str:
        """What a user would install."""
        return "pip install shardkit-fake-plugins"

    def local_device(self, local_rank: int) -> torch.device:
        """All ranks compute on the host."""
        return torch.device("cpu")

    def device_count(self) -> int:
        """The host is one device."""
        return 1

    def process_group_backend(self) -> str:
        """torch's bundled gloo."""
        return "gloo"

    def max_local_ranks(self) -> int | None:
        """Unlimited: the ranks are host processes sharing that one device."""
        return None


@hookimpl
def shardkit_register_backends(registry):
    """Register the toy backend."""
    registry.add(ToyGlooBackend)
