"""State transfer (docs/design.md section 7): a promoted spare receives a rank's exact training
state peer-to-peer from surviving replicas.

* ``snapshot``: the state as a table of tensors plus plain metadata (``Snapshot.capture``,
  ``restore``, ``RNGState``); ``tree``: that metadata's bounded msgpack codec;
* ``fingerprint``: chunk digests (xxh3 / blake3), the state fingerprint, control-frame tags;
* ``chunkmac``: the per-chunk MAC of the TCP transfer (GMAC, then keyed BLAKE3);
* ``frames``: bounded msgpack control frames on a socket; ``manifest``: the table a source sends;
* ``auth``: transfer keys derived from the cluster key, mutual challenge-response;
* ``server``: ``TransferServer`` serves the last published snapshot;
* ``client``: ``fetch`` pulls stripes from several sources with failover;
* ``state_transport``: the one interface, ``TcpTransport``; ``pg_transport``: torch.distributed.
"""

from .auth import TransferKeys
from .client import FetchResult, fetch
from .errors import PeerError, Refused, SnapshotChanged, TransferError, TransferFailed
from .server import TransferServer
from .snapshot import RNGState, Snapshot, Stateful, TensorEntry

__all__ = [
    "FetchResult", "PeerError", "RNGState", "Refused", "Snapshot", "SnapshotChanged",
    "Stateful", "TensorEntry",
    "TransferError", "TransferFailed", "TransferKeys", "TransferServer", "fetch",
]
