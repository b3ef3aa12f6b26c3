#!/usr/bin/env bash
# Per-kernel SASS of two builds side by side: for every object (.o) in BEFORE_DIR that AFTER_DIR
# also holds, each kernel's instruction count (NOPs left out: they are alignment padding),
# registers, stack and local bytes, before and after, and whether its instruction stream is the
# same (opcodes and operands; branch targets are offsets within the kernel, so an identical stream
# has identical targets). A restructuring meant to leave the kernels
# unchanged shows "same" on every row; a count that moved by more than 1%, a register more or a
# stack/local byte that appeared is marked "!". For each sm_90a kernel, also the size of its main
# loop (the innermost loop issuing tensor-core instructions, scripts/sass_loop.py) and of that
# loop's common path (every conditional block skipped): a change there moves the kernel's time
# even where the total barely moves.
#
#   bash scripts/sass-diff.sh BEFORE_DIR AFTER_DIR [ARCH]     # ARCH: sm_90a (default), sm_80, all
#
# cuobjdump and nvdisasm come with the CUDA toolkit, or from the nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm wheels (put their nvidia/cu13/bin on PATH, or set CUOBJDUMP).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BEFORE_DIR AFTER_DIR [sm_90a|sm_80|all]" >&2
  exit 2
fi
before=$1 after=$2 arch=${3:-sm_90a}
cuobjdump=${CUOBJDUMP:-cuobjdump}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

for b in "$before"/*.o; do
  name=$(basename "$b")
  a="$after/$name"
  [ -f "$a" ] || { echo "# $name: not in $after" >&2; continue; }
  for side in b a; do
    obj=$b
    [ $side = a ] && obj=$a
    "$cuobjdump" -sass "$obj" > "$tmp/$name.$side.sass"
    "$cuobjdump" -res-usage "$obj" > "$tmp/$name.$side.res"
  done
done

python3 - "$tmp" "$arch" "$(dirname "$0")" <<'EOF'
import collections, glob, hashlib, os, re, subprocess, sys

tmp, want = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
import sass_loop


def loops(path):
    """{mangled name: "loop/common" instruction counts of its main loop} (sm_90a: the dump's last
    code of each name)"""
    out = {}
    for name, ins in sass_loop.kernels(path).items():
        try:
            start, end = sass_loop.main_loop(ins)
        except (Exception, SystemExit):  # no loop with tensor-core instructions
            continue
        loop = [i for i in ins if start <= i[0] <= end]
        skips = [(addr + 16, t) for addr, pred, op, text in loop
                 if op.startswith("BRA") and pred and (t := sass_loop.branch_target(text))
                 and addr < t <= end]
        common = [i for i in loop if not any(s <= i[0] < e for s, e in skips)]
        out[name] = f"{len(loop)}/{len(common)}"
    return out


def sass(path):
    """{(arch, mangled name): (instruction count without NOPs, hash of the stream)}"""
    out, arch, name, body = {}, None, None, []

    def close():
        if name is not None:
            h = hashlib.sha1("\n".join(body).encode()).hexdigest()[:10]
            out[(arch, name)] = (sum(1 for t in body if not t.startswith("NOP")), h)

    for line in open(path):
        m = re.search(r"code for (sm_\w+)", line)
        if m:
            close()
            arch, name, body = m.group(1), None, []
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            close()
            name, body = m.group(1), []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line)
        if m and name:
            body.append(m.group(1))
    close()
    return out


def res(path):
    """{(arch, mangled name): (registers, stack, local)} in the order cuobjdump lists them."""
    out, arch, name = {}, None, None
    for line in open(path):
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
        m = re.search(r"Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
        if m and name:
            out[(arch, name)] = tuple(int(x) for x in m.groups())
            name = None
    return out


def short(mangled):
    s = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
    s = s.replace("sdpa::cutlass_sm90::", "").replace("sdpa::mask::", "").replace("cutlass::", "")
    s = re.sub(r"\(.*\)$", "", s)
    return s


rows, flagged = [], 0
for bs in sorted(glob.glob(os.path.join(tmp, "*.b.sass"))):
    obj = os.path.basename(bs)[: -len(".b.sass")]
    sb, sa = sass(bs), sass(bs[:-7] + ".a.sass")
    rb, ra = res(bs[:-7] + ".b.res"), res(bs[:-7] + ".a.res")
    lb, la = loops(bs), loops(bs[:-7] + ".a.sass")
    for key in sorted(set(sb) | set(sa)):
        arch, fn = key
        if want != "all" and arch != want:
            continue
        nb, hb = sb.get(key, (0, None))
        na, ha = sa.get(key, (0, None))
        regb, stb, lob = rb.get(key, (0, 0, 0))
        rega, sta, loa = ra.get(key, (0, 0, 0))
        same = hb == ha
        pct = 100.0 * (na - nb) / nb if nb else float("inf")
        bad = (abs(pct) > 1.0 or rega > regb or sta > stb or loa > lob) and not same
        flagged += bad
        lpb, lpa = (lb.get(fn, "-"), la.get(fn, "-")) if arch == "sm_90a" else ("-", "-")
        rows.append((obj.replace(".cu.o", ""), short(fn), arch, nb, na, pct, regb, rega,
                     f"{stb}/{lob}", f"{sta}/{loa}", "same" if same else ("!" if bad else "differs"),
                     lpb, lpa))

w = max([len(r[1]) for r in rows] + [6])
print(f"{'object':<20} {'kernel':<{w}} {'arch':<7} {'instr before':>12} {'after':>7} {'diff%':>7} "
      f"{'regs':>4} {'after':>5} {'stack/local':>11} {'after':>7} {'loop/common':>11} {'after':>9}  sass")
for r in rows:
    print(f"{r[0]:<20} {r[1]:<{w}} {r[2]:<7} {r[3]:>12} {r[4]:>7} {r[5]:>+7.2f} {r[6]:>4} {r[7]:>5} "
          f"{r[8]:>11} {r[9]:>7} {r[11]:>11} {r[12]:>9}  {r[10]}")
print(f"# {len(rows)} kernels, {sum(r[10] == 'same' for r in rows)} with the same SASS, {flagged} flagged (!)")
EOF
