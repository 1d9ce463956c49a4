"""`laminar trace summary|compare|plot|export`: what each subcommand prints or writes from a run's
traces (finished, still running or crashed). The `laminar` command (laminar_hpc/cli.py) parses the
arguments and prints a TraceAnalysisError as its one error line.

    trace_command(args)     # args: the parsed `laminar trace ...` namespace; returns the exit status
"""
from __future__ import annotations

import argparse
import json
import sys

from laminar_hpc.analysis import TraceAnalysisError, format_compare, format_summary, load_run, summarize
from laminar_hpc.analysis import write_perfetto
from laminar_hpc.metrics.summary import read_metrics


def trace_command(args: argparse.Namespace) -> int:
    if args.trace_command == "summary":
        d = summarize(load_run(args.run_dir), read_metrics(args.run_dir), buckets=args.buckets)
        print(json.dumps(d, indent=1, default=str) if args.json else format_summary(d))
    elif args.trace_command == "compare":
        a, b = (summarize(load_run(r), read_metrics(r), buckets=args.buckets) for r in (args.run_a, args.run_b))
        print(format_compare(a, b))
    elif args.trace_command == "plot":
        run = load_run(args.run_dir)
        try:
            from laminar_hpc.analysis.plot import plot_run
        except ImportError as err:
            raise TraceAnalysisError(f"`laminar trace plot` needs matplotlib ({err}): pip install matplotlib") from None
        _problems(run)
        print(f"wrote {plot_run(run, read_metrics(args.run_dir), args.output)}")
    elif args.trace_command == "export":
        run = load_run(args.run_dir)
        _problems(run)
        n = write_perfetto(run, args.output)
        print(f"wrote {args.output} ({n:,} trace events); open it in https://ui.perfetto.dev")
    return 0


def _problems(run) -> None:
    for line in run.problems:
        print(f"problem: {line}", file=sys.stderr)
