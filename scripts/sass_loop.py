"""The main loop of a kernel, from its SASS: the instructions of the innermost loop that issues
tensor-core instructions, its conditional blocks, and the common path (every conditional block
skipped), counted by opcode and by region between the starts of and waits for tensor-core groups.

    cuobjdump -sass target/release/sdpa > sdpa.sass     # or a .o of one kernel's translation unit
    python3 scripts/sass_loop.py sdpa.sass --kernel 'Elems.*bfloat16.*Li128E.*NoMask'

cuobjdump comes with the CUDA toolkit (/usr/local/cuda/bin on the GPU machine; elsewhere the
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels). A static count: what one iteration issues
per warp on its common path, not how often each path runs (ncu's source counters say that).
"""
import argparse, collections, re, sys

TENSOR = ("HGMMA", "HMMA", "QGMMA")


def kernels(path):
    """{mangled name: [(address, predicate, opcode, text)]} of every function in the dump."""
    out, name = {}, None
    for line in open(path):
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m and name:
            text = m.group(2)
            parts = text.split()
            pred = parts.pop(0) if parts[0].startswith("@") else ""
            out[name].append((int(m.group(1), 16), pred, parts[0], text))
    return out


def branch_target(text):
    m = re.search(r"BRA\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def main_loop(ins):
    """(start, end) of the innermost loop (backward branch) that issues tensor-core instructions:
    a kernel's key-tile loop rather than the tile loop around it."""
    best = None
    for addr, _, op, text in ins:
        t = branch_target(text) if op.startswith("BRA") else None
        if t is None or t >= addr:
            continue
        n = sum(1 for a, _, o, _ in ins if t <= a <= addr and o.startswith(TENSOR))
        if n and (best is None or addr - t < best[1] - best[0]):
            best = (t, addr)
    if best is None:
        sys.exit("no loop with tensor-core instructions in this kernel")
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", help="cuobjdump -sass output")
    ap.add_argument("--kernel", required=True, help="regex on the mangled kernel name")
    a = ap.parse_args()
    found = {k: v for k, v in kernels(a.sass).items() if re.search(a.kernel, k)}
    if len(found) != 1:
        sys.exit(f"{len(found)} kernels match {a.kernel!r}: " + ", ".join(sorted(found)[:8]))
    (name, ins), = found.items()
    start, end = main_loop(ins)
    loop = [i for i in ins if start <= i[0] <= end]
    # Conditional blocks: a predicated forward branch inside the loop skips to its target.
    skips = [(addr + 16, t) for addr, pred, op, text in loop
             if op.startswith("BRA") and pred and (t := branch_target(text)) and addr < t <= end]
    common = [i for i in loop if not any(s <= i[0] < e for s, e in skips)]
    print(f"{name}\nloop 0x{start:x}-0x{end:x}: {len(loop)} instructions; common path {len(common)}")
    for s, e in skips:
        print(f"  conditional block 0x{s:x}-0x{e:x}: {(e - s) // 16} instructions")
    # Regions of the common path: cut where a warpgroup starts a group of tensor-core
    # instructions (WARPGROUP.ARRIVE) and where it waits for one (WARPGROUP.DEPBAR).
    region, regions = [], []
    for i in common:
        if region and i[2].startswith(("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR")):
            regions.append(region)
            region = []
        region.append(i)
    regions.append(region)
    for r in regions:
        c = collections.Counter(op.split(".")[0] for _, _, op, _ in r)
        ops = ", ".join(f"{o} {n}" for o, n in c.most_common())
        print(f"  0x{r[0][0]:x}-0x{r[-1][0]:x} ({len(r)}): {ops}")
    total = collections.Counter(op.split(".")[0] for _, _, op, _ in common)
    print("common path by opcode: " + ", ".join(f"{o} {n}" for o, n in total.most_common()))


if __name__ == "__main__":
    main()
