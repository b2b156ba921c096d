"""Benchmark: what ``import fsdp2`` costs a fresh process, against
``import torch.distributed.fsdp`` (torch's FSDP, what a user imports to call
its fully_shard), interleaved.

Each run is a new Python process that times its one import with
``time.perf_counter`` (torch included: both import it first thing) and says
whether dynamo (``torch._dynamo``) was imported with it. Reported: the median
over runs of each import, and the median of the per-round differences.

    python scripts/bench_import.py            # 7 rounds, ~40 s
    python scripts/bench_import.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CONTENDERS = {"torch": "torch.distributed.fsdp", "fsdp2": "fsdp2"}

_CHILD = """
import json, sys, time
start = time.perf_counter()
import {module}
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "dynamo": "torch._dynamo" in sys.modules}}))
"""


def _one_import(module: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(module=module)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    for round_ in range(args.rounds):
        order = list(CONTENDERS) if round_ % 2 == 0 else list(reversed(CONTENDERS))
        for name in order:
            runs[name].append(_one_import(CONTENDERS[name]))
    seconds = {name: [r["seconds"] for r in rs] for name, rs in runs.items()}
    differences = [a - b for a, b in zip(seconds["fsdp2"], seconds["torch"], strict=True)]
    result = {
        "median_s": {name: statistics.median(s) for name, s in seconds.items()},
        "median_difference_s": statistics.median(differences),
        "dynamo_imported": {name: any(r["dynamo"] for r in rs) for name, rs in runs.items()},
        "rounds": args.rounds,
    }
    print(f"import time, median of {args.rounds} fresh processes each (interleaved)")
    print("| import | median | dynamo imported |")
    print("| --- | --- | --- |")
    for name, module in CONTENDERS.items():
        loaded = "yes" if result["dynamo_imported"][name] else "no"
        print(f"| `import {module}` | {result['median_s'][name]:.2f} s | {loaded} |")
    print(
        f"fsdp2 - torch, median of the rounds' differences: {result['median_difference_s']:+.2f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
