"""Side-by-side census of kernels profiled by ncu: time, pipe use, stall reasons and executed
instructions by opcode, from ncu's text output (one launch a file).

On the GPU machine, one file a kernel, in the same device call:

    NCU="ncu --section SpeedOfLight --section InstructionStats --section WarpStateStats \\
         --metrics sass__inst_executed_per_opcode --print-details all \\
         --print-metric-instances details --launch-skip 3 --launch-count 1"
    $NCU --kernel-name regex:fwd sdpa bench --backend cutlass --dtype bf16 \\
         --problem s8k-d128 --budget-ms 20 > ours.txt
    $NCU --kernel-name regex:"Flash|flash" python3 .gpu/sdpa_anchor.py --backends fa4 \\
         --shapes s8k-d128 --dtypes bf16 > fa4.txt

Then anywhere:

    python3 scripts/ncu_census.py ours.txt fa4.txt --per 524288

--per divides the instruction counts, e.g. by the launch's (key tiles x consumer warps) for
counts a warp and key tile (s8k-d128: 65 536 key tiles of 128 x 128, 8 consumer warps).
"""
import argparse
import re
import sys

SUMMARY = [  # (label, ncu's metric name as printed)
    ("duration us", "Duration"),
    ("SM clock GHz", "SM Frequency"),
    ("compute (SM) busy %", "Compute (SM) Throughput"),
    ("issue slots busy %", "Issue Slots Busy"),
    ("warp cycles / issued instruction", "Warp Cycles Per Issued Instruction"),
    ("executed instructions", "Executed Instructions"),
]


def number(text):
    return float(text.replace(",", ""))


def parse(path):
    """The summary metrics, the stall reasons (a warp-instruction) and the opcode counts."""
    text = open(path, encoding="utf-8", errors="replace").read()
    summary = {}
    scale = {"ms": 1e3, "s": 1e6, "ns": 1e-3}  # durations to us
    for label, name in SUMMARY:
        m = re.search(rf"^\s+{re.escape(name)}\s+(?:(\S+)\s+)?([\d.,]+)\s*$", text, re.M)
        if m:
            unit = scale.get(m.group(1), 1.0) if label == "duration us" else 1.0
            summary[label] = number(m.group(2)) * unit
    stalls = {}
    table = re.search(r"Warp State \(All Cycles\)(.*?)(?:WRN|Section:|\Z)", text, re.S)
    if table:
        for m in re.finditer(r"^\s+(Stall [A-Za-z ]+?)\s+inst\s+([\d.]+)\s*$", table.group(1), re.M):
            stalls[m.group(1)] = float(m.group(2))
    opcodes = {}
    m = re.search(r"sass__inst_executed_per_opcode\s+[\d,]+\s+\((.*?)\)", text, re.S)
    if m:
        body = re.sub(r"\s+", " ", m.group(1))
        for op, count in re.findall(r"([A-Z0-9_.]+): ([\d,]+)", body):
            opcodes[op] = number(count)
    return summary, stalls, opcodes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="ncu text outputs, one kernel each")
    ap.add_argument("--per", type=float, default=1.0, help="divide instruction counts by this")
    ap.add_argument("--top", type=int, default=30, help="opcodes to show (by the largest count)")
    args = ap.parse_args(argv)
    runs = [parse(f) for f in args.files]
    names = [f.rsplit("/", 1)[-1] for f in args.files]
    width = max(12, *(len(n) for n in names))
    row = lambda label, cells: print(f"{label:36s}" + "".join(f"{c:>{width + 2}}" for c in cells))
    row("", names)
    for label, _ in SUMMARY:
        cells = []
        for summary, _, _ in runs:
            v = summary.get(label)
            cells.append("-" if v is None else f"{v / (args.per if label == 'executed instructions' else 1):,.4g}")
        row(label, cells)
    print("stalls a warp-instruction:")
    for stall in sorted({s for _, st, _ in runs for s in st}, key=lambda s: -max(r[1].get(s, 0) for r in runs)):
        if max(r[1].get(stall, 0) for r in runs) < 0.01:
            continue
        row("  " + stall, [f"{r[1].get(stall, 0):.2f}" for r in runs])
    ops = {o for _, _, oc in runs for o in oc}
    if ops:
        print(f"executed instructions by opcode (/ {args.per:g}):")
        for op in sorted(ops, key=lambda o: -max(r[2].get(o, 0) for r in runs))[: args.top]:
            row("  " + op, [f"{r[2].get(op, 0) / args.per:,.1f}" for r in runs])
    missing = [n for n, r in zip(names, runs) if not r[0]]
    if missing:
        print(f"no ncu metrics found in: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
