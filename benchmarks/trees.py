"""A CPU benchmark's measurement run in child processes, alternating between configurations:
this tree's ``mtplx`` (under environment variables of its own) and, with ``--baseline-tree``,
another checkout's (an earlier commit's worktree, its C++ kernels built apart in its ``.ext``).
Each child prints its result as JSON on its last line; the kernels are chosen once per process,
and alternating rounds let machine noise hit every configuration alike."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every such benchmark takes: ``--baseline-tree``, ``--json`` (the report), and
    ``--child`` (hidden: ``rounds`` starts each child with it)."""
    ap.add_argument("--baseline-tree", help="a checkout whose mtplx package runs as 'baseline'")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def with_baseline(envs: dict[str, dict], baseline_tree: str | None) -> dict[str, tuple[dict, str | None]]:
    """``envs`` (name -> environment, run in this tree) as name -> (environment, working
    directory), plus "baseline" running ``baseline_tree``'s package where one is given."""
    out = {name: (env, None) for name, env in envs.items()}
    if baseline_tree:
        tree = os.path.abspath(baseline_tree)
        out["baseline"] = ({**os.environ, "PYTHONPATH": tree, "TORCH_EXTENSIONS_DIR": os.path.join(tree, ".ext")},
                           tree)
    return out


def rounds(script: str, argv: list[str], envs: dict[str, tuple[dict, str | None]], count: int, start: int = 0):
    """Yield (name, the child's JSON result) for ``count`` rounds over ``envs`` in turn, each child
    ``script --child *argv``; every other round in the reverse order. (In a fixed order the first
    child ran slower: one tree against itself read 0.944x AR and 0.907x MTP for whichever came
    first, three rounds of cpu_sampled.py on this project's 2-core VM, session 30). ``start``: the
    first round's index (a caller running one round at a time passes each one's)."""
    for r in range(start, start + count):
        items = list(envs.items())
        for name, (env, cwd) in items[::-1] if r % 2 else items:
            cmd = [sys.executable, os.path.abspath(script), "--child", *argv]
            done = subprocess.run(cmd, env=env, cwd=cwd, check=True, capture_output=True, text=True)
            yield name, json.loads(done.stdout.splitlines()[-1])
