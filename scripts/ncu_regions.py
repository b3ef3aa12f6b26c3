"""Where an sm_90a forward kernel's consumer warps spend a work tile, from ncu's source counters:
their stall samples and executed instructions split into the tile's start (up to the key loop),
the key loop, and the tile's end (the last P·V and the epilogue), and the waits on each
mbarrier of the shared storage.

On the GPU machine (one launch; the source page exported as CSV):

    ncu --kernel-name regex:fwd_kernel --launch-skip 3 --launch-count 1 \\
        --section SourceCounters --import-source yes -o varlen \\
        sdpa bench --backend cutlass --dtype bf16 --budget-ms 20 --problem varlen-16
    ncu -i varlen.ncu-rep --page source --csv --print-source sass > varlen-sass.csv

Then anywhere:

    python3 scripts/ncu_regions.py varlen-sass.csv [--top 12]

Any other kernel (no producer and consumer warpgroups: decode, the combine), `--runs` splits its
code into runs of consecutive instructions that each warp executes equally often (straight-line
code once, a loop's body n times), with their stall samples:

    python3 scripts/ncu_regions.py decode-sass.csv --runs

The consumers' code runs from the warpgroup's register allocation (USETMAXREG.TRY_ALLOC) to the
producer's release of its registers (USETMAXREG.DEALLOC). The key loop is the smallest loop
there with a wgmma in it; a work tile is one execution of the first HGMMA before it (round 0's
S = Q·Kᵀ), a step one of the loop's first. A wait is the branch after an mbarrier try-wait; it is named by the
barrier's offset in shared memory (the layout: TileConfig::Smem).
"""
import argparse
import csv
import re
import sys


def read(path):
    """[(address, source text, samples, executed)] of every SASS instruction, in address order."""
    rows = list(csv.reader(open(path)))
    header = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    hdr = rows[header]
    addr, src = hdr.index("Address"), hdr.index("Source")
    samples = hdr.index("Warp Stall Sampling (All Samples)")
    executed = hdr.index("Instructions Executed")
    ins = []
    for r in rows[header + 1:]:
        if "Address" in r:  # the next profiled launch's listing: one launch is read
            break
        if len(r) > executed:
            ins.append((int(r[addr], 16), r[src].strip(), int(r[samples] or 0),
                        int(r[executed] or 0)))
    return ins


def runs(ins, share=0.01):
    """Prints the runs of consecutive instructions each warp executes equally often, those with
    at least `share` of the samples: where a short kernel's time goes, in code order."""
    warps = ins[0][3]  # every warp executes the entry instruction once
    total = sum(x[2] for x in ins)
    print(f"samples: {total}; {warps} warps, {sum(x[3] for x in ins) / warps:.0f} "
          "instructions a warp")
    first = 0
    for i in range(1, len(ins) + 1):
        if i < len(ins) and ins[i][3] == ins[first][3]:
            continue
        s = sum(x[2] for x in ins[first:i])
        if ins[first][3] and s >= share * total:
            print(f"  {first:6d}-{i - 1:<6d} {ins[first][3] / warps:5.2f} times a warp, "
                  f"{i - first:5d} instructions, {s:6d} samples ({100 * s / total:4.1f}%)  "
                  f"{ins[first][1][:50]}")
        first = i


def regions(ins):
    """(consumer start, loop start, loop end, consumer end) as indices: the key loop is the
    smallest loop (a branch back to an earlier address) with a wgmma in it."""
    begin = next(i for i, x in enumerate(ins) if "USETMAXREG.TRY_ALLOC" in x[1])
    end = next((i for i, x in enumerate(ins) if "USETMAXREG.DEALLOC" in x[1]), len(ins))
    at = {x[0]: i for i, x in enumerate(ins)}
    loops = []
    for i in range(begin, end):
        m = re.search(r"\bBRA (?:`\()?(0x[0-9a-f]+)", ins[i][1])
        target = at.get(int(m.group(1), 16)) if m else None
        if target is not None and begin <= target < i and any(
                "HGMMA" in x[1] for x in ins[target:i]):
            loops.append((i - target, target, i + 1))
    if not loops:
        sys.exit("no key loop: no branch back over a wgmma in the consumers' code")
    _, loop0, loop1 = min(loops)
    return begin, loop0, loop1, end


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=10, help="most-sampled instructions a region")
    ap.add_argument("--runs", action="store_true",
                    help="any kernel: runs of instructions executed equally often")
    args = ap.parse_args()
    ins = read(args.csv)
    if args.runs:
        return runs(ins)
    begin, loop0, loop1, end = regions(ins)
    tiles = next(x[3] for x in ins[begin:loop0] if "HGMMA" in x[1])  # round 0's S
    steps = next(x[3] for x in ins[loop0:loop1] if "HGMMA" in x[1])
    total = sum(x[2] for x in ins)
    consumers = sum(x[2] for x in ins[begin:end])
    print(f"samples: {total} in all, {consumers} the consumers'; "
          f"{tiles} warp-tiles, {steps / tiles:.2f} loop steps a tile")
    for name, a, b, per, unit in (("tile start", begin, loop0, tiles, "tile"),
                                  ("key loop", loop0, loop1, steps, "step"),
                                  ("tile end", loop1, end, tiles, "tile")):
        s = sum(x[2] for x in ins[a:b])
        n = sum(x[3] for x in ins[a:b]) / per
        print(f"\n{name}: {s} samples ({100 * s / consumers:.1f}% of the consumers'), "
              f"{n:.0f} instructions a warp and {unit}")
        top = sorted(range(a, b), key=lambda i: -ins[i][2])[:args.top]
        for i in sorted(top):
            _, t, x, e = ins[i]
            if x:
                print(f"  {i:6d} {x:6d} ex {e:9d}  {t[:80]}")
    print("\nwaits (the branch after each try-wait), by barrier offset:")
    for i, (_, t, _, e) in enumerate(ins):
        m = re.search(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT \S+, \[(.*?)\]", t)
        if m and i + 1 < len(ins) and ins[i + 1][2] > 0:
            off = re.search(r"0x[0-9a-f]+", m.group(1))
            role = "consumer" if begin <= i < end else "producer"
            print(f"  {i:6d} {role:8s} {off.group(0) if off else m.group(1):10s} "
                  f"{ins[i + 1][2]:6d} samples, ex {e}")


if __name__ == "__main__":
    main()
