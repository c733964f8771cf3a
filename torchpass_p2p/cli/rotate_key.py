"""``torchpass-p2p rotate-key KEY_FILE``: rotate the cluster key of a running job, one step at a
time, without removing a member or losing a step (``docs/running.md``, "Keys").

1. ``rotate-key KEY_FILE --launcher PID``: a fresh key becomes the primary and the keys listed
   before stay accepted; the launcher (SIGHUP) has every agent read the file again. Members
   seal under the new key from then on, and a process still on the old key (a spare started
   from an old copy of the file) still joins and is still heard.
2. ``rotate-key KEY_FILE --drop-old --launcher PID``: only the primary stays. From then on a
   process on an old key is refused: it exits with code 6 and one line.

Over several hosts, every host needs the same key: run step 1 on one host, copy the file to
the others (keeping mode 0600), then signal each host's launcher; step 2 likewise. Without
``--launcher`` the file is only rewritten: send SIGHUP yourself (``kill -HUP PID``).

Prints key ids, never keys. Exit code: 0 done, 1 refused (nothing to drop, the launcher could
not be signalled), 2 for a usage error or a key file that cannot be read or written.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from torchpass_p2p.agent.settings import SettingsError, read_keys
from torchpass_p2p.cli import plain
from torchpass_p2p.core.seal import key_id
from torchpass_p2p.launch.keyfile import KeyFileError, replace_key_file, rotated_keys

__all__ = ["EXIT_REFUSED", "EXIT_USAGE", "add_parser", "run"]

EXIT_REFUSED = 1
EXIT_USAGE = 2


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register this command's parser (``set_defaults(func=run)``) and return it."""
    p = subparsers.add_parser(
        "rotate-key", help="add a new primary key to a key file, or drop the old ones",
        description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("key_file", metavar="KEY_FILE", help="the job's key file (the launcher's "
                   "--key-file, or RUN_DIR/cluster.key)")
    p.add_argument("--drop-old", action="store_true",
                   help="keep the primary key only (step 2)")
    p.add_argument("--launcher", type=int, metavar="PID",
                   help="send SIGHUP to this launcher once the file is written")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        keys = read_keys(args.key_file)
    except (SettingsError, OSError) as exc:
        print(f"torchpass-p2p rotate-key: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        new = rotated_keys(keys, drop_old=args.drop_old)
    except KeyFileError as exc:
        print(f"torchpass-p2p rotate-key: {args.key_file}: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        replace_key_file(args.key_file, new)
    except (KeyFileError, OSError) as exc:
        print(f"torchpass-p2p rotate-key: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ids = [key_id(k) for k in new]
    print(f"{args.key_file}: primary key id {ids[0]}, accepted key ids "
          f"{', '.join(map(str, ids))} (were {', '.join(str(key_id(k)) for k in keys)})")
    if args.launcher is None:
        print("send SIGHUP to the launcher(s) using this file (kill -HUP PID) to reload it")
        return 0
    try:
        os.kill(args.launcher, signal.SIGHUP)
    except OSError as exc:
        print(f"torchpass-p2p rotate-key: launcher {args.launcher} not signalled: {exc}",
              file=sys.stderr)
        return EXIT_REFUSED
    print(f"sent SIGHUP to launcher {args.launcher}: its log says how many processes reloaded")
    return 0
