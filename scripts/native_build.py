"""Compile the simulator's hot path with mypyc, in place (run by scripts/build-native).

The protocol core and the simulator engine are plain, fully typed Python; mypyc turns the same
source into C extensions that run the simulator 3-4x as fast (measured by
benchmarks/sim_speed.py). The pure-Python modules stay the reference: everything works without
this step, and `torchpass_p2p` drops a compiled module whose source is newer than it.

``messages.py`` is compiled too: a compiled message class checks its fields' types when built
(TypeError), a stricter local check on top of the codec's, which still rejects every wrongly typed
field a peer sends with a DecodeError before building anything. Not compiled:
``codec.py``/``wire.py`` (their contract is to raise only DecodeError on any input, whatever its
type, and msgpack's C parser does their heavy lifting anyway).
"""

from __future__ import annotations

import sys

from mypyc.build import mypycify
from setuptools import setup

MODULES = [
    "torchpass_p2p/core/messages.py",
    "torchpass_p2p/core/events.py",
    "torchpass_p2p/core/params.py",
    "torchpass_p2p/core/hashing.py",
    "torchpass_p2p/core/configuration.py",
    "torchpass_p2p/core/membership.py",
    "torchpass_p2p/core/reconfiguration.py",
    "torchpass_p2p/core/agreement.py",
    "torchpass_p2p/core/cut.py",
    "torchpass_p2p/core/sizes.py",
    "sims/engine.py",
    "sims/network.py",
    "sims/cluster.py",
]

if __name__ == "__main__":
    setup(
        name="torchpass_p2p_native",
        ext_modules=mypycify(MODULES, opt_level="3", group_name="torchpass_p2p_native"),
        script_args=["build_ext", "--inplace", *sys.argv[1:]],
    )
