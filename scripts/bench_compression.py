"""Training quality and bytes of fsdp2.CompressionPolicy on the demo model.

    python scripts/bench_compression.py                 # 300 steps per setting, 2 gloo ranks
    python scripts/bench_compression.py --steps 50      # a quicker look

Runs scripts/train.py once per setting from the same initial weights and data
order (same --seed), and compares each setting's final loss (mean of the last
20 steps) with the uncompressed run's, the bytes each rank sends per step,
and the step time (on CPU the (de)quantization is paid by the cores that
compute; gloo's bytes are cheap next to it). The runs go to
runs/compression/<setting>/ and the table to runs/compression/summary.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, list[str]] = {
    "uncompressed": [],
    "weights int8": ["--compress-weights", "int8"],
    "gradients bf16": ["--compress-grads", "bf16"],
    "gradients int8": ["--compress-grads", "int8"],
    "weights int8 + gradients int8": ["--compress-weights", "int8", "--compress-grads", "int8"],
}
TAIL = 20  # steps averaged for the final loss
TOLERANCE = 0.02  # the issue's bar: within 2 % of uncompressed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "runs" / "compression"))
    p.add_argument("--only", nargs="*", help="settings to run (default: all)")
    p.add_argument("--seed", type=int, default=0, help="train.py's --seed: weights and data")
    args = p.parse_args()
    out = Path(args.out)
    rows = {}
    for name, flags in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        run_dir = out / name.replace(" ", "_").replace("+", "and")
        shutil.rmtree(run_dir, ignore_errors=True)  # train.py refuses a used run folder
        command = [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            *("--nproc", str(args.nproc), "--steps", str(args.steps)),
            *("--run-dir", str(run_dir), "--ckpt-every", "0", "--sample-tokens", "0"),
            *("--log-every", "100", "--seed", str(args.seed)),
            *flags,
        ]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, cwd=REPO)
        metrics = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        tail = metrics[-TAIL:]
        steady = metrics[5:]  # the first steps include warm-up allocations
        rows[name] = {
            "final_loss": sum(m["loss"] for m in tail) / len(tail),
            "step_time_s": sorted(m["step_time_s"] for m in steady)[len(steady) // 2],
            "comm_bytes": metrics[-1]["comm_bytes"],
        }
    base = rows.get("uncompressed")
    print(
        f"\n{'setting':32} {'final loss':>10} {'vs off':>8} {'all-gather':>11} "
        f"{'reduce':>9} {'step (median)':>14}"
    )
    for name, row in rows.items():
        ratio = "" if base is None else f"{row['final_loss'] / base['final_loss'] - 1:+.2%}"
        row["loss_vs_uncompressed"] = ratio
        ag = row["comm_bytes"]["all_gather"]
        rs = row["comm_bytes"]["reduce_scatter"]
        if base is not None:
            ag_s = f"{ag / base['comm_bytes']['all_gather']:.3f}x"
            rs_s = f"{rs / base['comm_bytes']['reduce_scatter']:.3f}x"
        else:
            ag_s, rs_s = str(ag), str(rs)
        print(
            f"{name:32} {row['final_loss']:10.4f} {ratio:>8} {ag_s:>11} {rs_s:>9} "
            f"{row['step_time_s'] * 1e3:11.0f} ms"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    if base is not None:
        worst = max(abs(r["final_loss"] / base["final_loss"] - 1) for r in rows.values())
        verdict = "within" if worst <= TOLERANCE else "NOT within"
        print(f"\nevery setting {verdict} {TOLERANCE:.0%} of uncompressed (worst {worst:.2%})")


if __name__ == "__main__":
    main()
