"""Print the mutation score of ``make mutate`` (mutmut's CI/CD stats) and fail under a minimum.

Killed and timed-out mutants count as detected (a mutant that hangs the labeller is caught by the
suite's timeout); survivors and mutants no test reaches count against the score."""

from __future__ import annotations

import argparse
import json
import sys


def score(stats: dict[str, int]) -> tuple[int, int, float]:
    detected = stats["killed"] + stats["timeout"]
    total = stats["total"] - stats.get("skipped", 0)
    return detected, total, 100.0 * detected / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("stats", help="mutants/mutmut-cicd-stats.json")
    ap.add_argument("--min", type=float, default=90.0, help="minimum score in percent")
    args = ap.parse_args(argv)
    with open(args.stats, encoding="utf-8") as f:
        stats = json.load(f)
    detected, total, pct = score(stats)
    print(f"mutants: {total}, killed {stats['killed']}, timeout {stats['timeout']}, survived {stats['survived']}, "
          f"no tests {stats['no_tests']}, suspicious {stats['suspicious']}")
    print(f"mutation score {pct:.1f}% ({detected}/{total}; minimum {args.min:.0f}%)")
    return 0 if pct >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())
