"""The discrete-event simulator: thousands of real protocol cores on a virtual clock."""

from torchpass_p2p._native import drop_stale_extensions, prefer_sources

prefer_sources()
drop_stale_extensions(__path__[0])
