"""The decided-configuration latency at N members, read from the calibration table.

The table (``data/decided_latency.json``, written by ``python -m sims jobmodel --calibrate``)
holds, for a few member counts, the seconds from a fault until every live member decided the
configuration that replaces it, from runs of the real protocol core in the simulator
(:mod:`sims.fleetmodel.calibrate`): one rank's crash (scope ``gpu``) and a whole host's
(scope ``host``).

Between measured counts the latency is interpolated linearly in log2 N. Above the largest it is
the least-squares line in log2 N through all measured points (gossip spreads an update in
O(log N) rounds, and each member has K observers whatever N), never below the largest measured
value; below the smallest, the smallest's value. Every figure the model prints from here says
it is an extrapolation when N is beyond the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .sources import DECIDED_LATENCY, decided_table


@dataclass(frozen=True, slots=True)
class DecidedLatency:
    """Seconds from a fault to every live member's decision, by scope and member count."""

    points: dict[str, tuple[tuple[int, float], ...]]
    """scope -> ((members, seconds), ...) sorted by members."""
    source: str

    @classmethod
    def load(cls) -> DecidedLatency:
        """From ``data/decided_latency.json``.

        Raises:
            FileNotFoundError: the table was never generated.
        """
        table = decided_table()
        points = {scope: tuple(sorted((int(row["members"]), float(row["decided_all_s"]))
                                      for row in rows))
                  for scope, rows in table["scopes"].items()}
        members = sorted({n for rows in points.values() for n, _ in rows})
        source = (f"{DECIDED_LATENCY.relative_to(DECIDED_LATENCY.parents[3])}: "
                  f"{table['generated_by']}; {table['scenario']}; measured at "
                  f"{', '.join(map(str, members))} members, log2-linear fit beyond")
        return cls(points, source)

    @property
    def largest(self) -> int:
        """The largest member count measured."""
        return max(n for rows in self.points.values() for n, _ in rows)

    def at(self, members: int, scope: str) -> float:
        """Seconds at ``members`` for a failure of ``scope`` (``"job"``: 0, no decision).

        Raises:
            KeyError: a scope the table lacks.
        """
        if scope == "job":
            return 0.0
        rows = self.points[scope]
        x = math.log2(max(members, 1))
        if members <= rows[0][0]:
            return rows[0][1]
        for (n0, s0), (n1, s1) in zip(rows, rows[1:], strict=False):
            if members <= n1:
                x0, x1 = math.log2(n0), math.log2(n1)
                return s0 + (s1 - s0) * (x - x0) / (x1 - x0)
        slope, intercept = fit(rows)
        return max(rows[-1][1], intercept + slope * x)


def fit(rows: tuple[tuple[int, float], ...]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of seconds against log2(members)."""
    xs = [math.log2(n) for n, _ in rows]
    ys = [s for _, s in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys,
                                                                          strict=True)) / sxx
    return slope, my - slope * mx
