"""``python -m jaxflow.results``: record a run, render the pages, or check them.

    python -m jaxflow.results record RUN_DIR [--load-start L] [--load-end L]
    python -m jaxflow.results render
    python -m jaxflow.results --check        # exit 1, one line per problem (CI)
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxflow.errors import UserError, one_line


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; returns the exit status (0 ok, 1 problems found, 2 bad input)."""
    from jaxflow.results import check as checks
    from jaxflow.results.record import record_run

    p = argparse.ArgumentParser(prog="python -m jaxflow.results", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare pages with their render; exit 1 on a problem")
    sub = p.add_subparsers(dest="command")
    rec = sub.add_parser("record", help="record a finished run directory into experiments/results")
    rec.add_argument("run_dir")
    rec.add_argument("--load-start", type=float, default=None, help="1-minute load when the run started")
    rec.add_argument("--load-end", type=float, default=None, help="1-minute load when it ended (default: now)")
    sub.add_parser("render", help="rewrite the pages from the records and templates")
    args = p.parse_args(argv)
    try:
        if args.check:
            problems = checks.check()
            for line in problems:
                print(line)
            print(f"jaxflow.results --check: {len(problems)} problem(s)" if problems else
                  "jaxflow.results --check: pages, records and templates agree")
            return 1 if problems else 0
        if args.command == "record":
            path = record_run(args.run_dir, load_start=args.load_start, load_end=args.load_end)
            print(f"recorded {path}")
            args.command = "render"
        if args.command == "render":
            for rel in checks.render_all():
                print(f"rendered {rel}")
            return 0
    except UserError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    p.print_usage()
    return 2


if __name__ == "__main__":
    sys.exit(main())
