"""The collective per configuration (docs/design.md section 8, issue #7 part 1).

* ``rendezvous``: where the store of configuration ``c`` lives (the holder of rank 0 in ``c``
  hosts it and announces it through its agent) and the per-configuration key namespace;
* ``group``: one process group of one configuration, every wait sliced and watched so a new
  configuration can take over, abandoned rather than aborted (gloo cannot abort);
* ``reduce``: flattening gradients and the fixed-order sum that makes results bitwise equal
  whatever algorithm the backend would use.
"""

from .group import (
    CollectiveError,
    GroupSpec,
    ManagedGroup,
    Superseded,
    build_group,
    exit_process,
)
from .reduce import flatten, sum_in_rank_order, unflatten_into
from .rendezvous import (
    ServiceDirectory,
    StoreKeeper,
    connect_store,
    store_prefix,
    store_service,
)

__all__ = [
    "CollectiveError", "GroupSpec", "ManagedGroup", "ServiceDirectory", "StoreKeeper",
    "Superseded", "build_group", "connect_store", "exit_process", "flatten", "store_prefix",
    "store_service", "sum_in_rank_order", "unflatten_into",
]
