"""Compile the native pulse responder, in place (run by scripts/build-native).

``torchpass_p2p/agent/_pulse.c`` is C, not a compiled copy of Python code: there is no
pure-Python fallback, so it is built even under ``TORCHPASS_PURE_PYTHON=1``. Without it the
project still works, without fast conviction (torchpass_p2p.agent.pulse_wire.available()).
Needs a C compiler and OpenSSL's libcrypto with its headers.
"""

from __future__ import annotations

import sys
import tempfile

from setuptools import Extension, setup

SOURCE = "torchpass_p2p/agent/_pulse.c"

if __name__ == "__main__":
    # A private scratch directory, not build/: the mypyc step (or a second checkout's build
    # running at the same time) owns and deletes that one.
    with tempfile.TemporaryDirectory(prefix="pulse-build-") as scratch:
        setup(
            name="torchpass_p2p_pulse",
            ext_modules=[Extension(
                "torchpass_p2p.agent._pulse", [SOURCE], libraries=["crypto"],
                extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                    ],
            )],
            script_args=["build_ext", "--inplace", "--build-temp", scratch, "--build-lib",
                         scratch, *sys.argv[1:]],
        )
