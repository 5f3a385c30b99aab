"""``codebuddy2api doctor URL``: probe an upstream the way the gateway will call it and
report its quirks. :mod:`gateway.doctor.findings` is the pure analyser;
:mod:`gateway.doctor.probe` the thin httpx shell that feeds it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gateway.doctor.findings import Report, analyse, render_table
from gateway.doctor.probe import run_probes

__all__ = ["Report", "analyse", "doctor_command", "render_table", "run_probes"]


def doctor_command(args: argparse.Namespace) -> int:
    """Exit 0: nothing the gateway cannot normalise; 1: problems found; 2: bad URL."""
    from gateway.settings import check_base_url

    try:
        check_base_url(args.url)
    except ValueError as exc:
        print(f"codebuddy2api: error: doctor: {exc}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("CODEBUDDY2API_UPSTREAM_API_KEY") or None
    probes = run_probes(args.url, api_key, args.model, timeout=args.timeout, tool_choice=args.tool_choice)
    report = analyse(probes)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        sys.stdout.write(render_table(report))
    return 1 if report.problems() else 0
