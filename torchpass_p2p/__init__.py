"""torchpass_p2p: keep PyTorch training jobs running through hardware faults.

Layers (DESIGN section 3): ``core`` is the sans-IO protocol (membership, wire format), driven by
the simulator in ``sims`` and, later, by the agent runtime.
"""

from ._native import drop_stale_extensions, prefer_sources

prefer_sources()
drop_stale_extensions(__path__[0])

__version__ = "0.1.0"
