"""Static SASS census of a CUDA kernel's loops: instructions per loop body by class.

Reads the text ``nvdisasm -c -g -gi`` writes for a cubin (``-g -gi``: the ``//## File ...,
line N [inlined at ...]`` comments that map each instruction back to its source line and
inlining chain; the cubin needs ``nvcc -lineinfo``), splits it
into functions, finds the loops (a branch to a label at or before it), and counts a loop
body's instructions by class, optionally those of one source line range only. It counts
what the code holds, not what runs: a branch-guarded block (a rare rescale, thread 0's
refill) counts once, so callers report such blocks apart (``blocks``). No GPU needed:

    nvcc -gencode=arch=compute_90,code=sm_90 -O3 -cubin -lineinfo cuda/decode_attention.cu \\
        -o /tmp/da.cubin
    nvdisasm -c -g -gi /tmp/da.cubin > /tmp/da.sass
    python -m sglang_diffkv.kernels.sass_census /tmp/da.sass --function 'Li1ELi2ELi4E' \\
        --function-has bfloat16

(CUDA 13's toolkit may ship without nvdisasm; Triton's wheel carries one under
``triton/backends/nvidia/bin``.)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass, field

# class of an opcode (its first dot-separated part, the predicate stripped), first match wins;
# "ldg" also holds the constant-bank loads (LDC / ULDC), "int" the uniform-datapath integer ops
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mma", ("HMMA", "IMMA", "HGMMA")),
    ("unpack", ("LOP3", "PRMT", "SHF", "LOP", "BMSK", "SGXT", "BFE", "BFI")),
    ("fp32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK", "FSET")),
    ("fp16", ("HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2", "F2FP", "F2F", "HSET2")),
    ("mufu", ("MUFU",)),
    ("shfl", ("SHFL", "VOTE", "VOTEU", "MATCH", "REDUX")),
    ("lds", ("LDS", "LDSM")),
    ("sts", ("STS",)),
    ("ldg", ("LDG", "LDGSTS", "LD", "LDC", "ULDC")),
    ("stg", ("STG", "ST", "RED", "ATOMG")),
    ("bulk", ("UBLKCP", "UTMALDG", "UBLKPF", "ELECT", "R2UR")),
    ("sync", ("SYNCS", "BAR", "MEMBAR", "FENCE", "DEPBAR", "WARPSYNC", "NANOSLEEP")),
    ("branch", ("BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "JMP", "BREAK", "YIELD")),
    ("predicate", ("ISETP", "PLOP3", "P2R", "R2P", "SEL", "FSEL", "CSET", "PSETP", "VOTE")),
    ("int", ("IMAD", "IADD3", "IADD", "VIADD", "LEA", "IABS", "IMNMX", "VIMNMX", "FLO", "POPC",
             "IMUL", "ISCADD", "S2R", "S2UR", "CS2R", "UIADD3", "UIMAD", "ULEA", "USHF",
             "ULOP3", "UMOV", "USEL", "UISETP", "UPRMT", "UFLO", "UPOPC", "ULOP")),
    ("move", ("MOV", "NOP")),
    ("convert", ("I2F", "F2I", "I2FP", "F2IP", "FRND")),
)

_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LINE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_LABEL = re.compile(r"^(\.L_x_\d+):")
_FUNC = re.compile(r"^\.text\.(\S+):\s*$")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Insn:
    addr: int
    text: str              # predicate and operands, no trailing ';'
    opcode: str            # e.g. "LOP3.LUT"
    lines: tuple[tuple[str, int], ...]  # (file, line) of the inlining chain, innermost first
    target: str | None = None  # a branch's label

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


@dataclass
class Function:
    name: str
    insns: list[Insn] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)  # label -> address


def classify(opcode: str) -> str:
    base = opcode.split(".")[0]
    for name, ops in CLASSES:
        if base in ops:
            return name
    return "other"


def parse(text: str) -> list[Function]:
    """Functions of an ``nvdisasm -c -g -gi`` listing, each with its instructions and labels."""
    funcs: list[Function] = []
    cur: Function | None = None
    chain: list[int] = []
    pending_chain = False  # a new //## block replaces the previous chain
    pending_labels: list[str] = []
    for raw in text.splitlines():
        m = _FUNC.match(raw)
        if m:
            cur = Function(m.group(1))
            funcs.append(cur)
            chain, pending_labels = [], []
            continue
        if cur is None:
            continue
        m = _LINE.match(raw)
        if m:
            if not pending_chain:
                chain = []
                pending_chain = True
            chain.append((m.group(1), int(m.group(2))))
            continue
        m = _LABEL.match(raw)
        if m:
            pending_labels.append(m.group(1))
            continue
        m = _INSN.match(raw)
        if m:
            pending_chain = False
            addr, body = int(m.group(1), 16), m.group(2)
            for lab in pending_labels:
                cur.labels[lab] = addr
            pending_labels = []
            words = body.split()
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            t = _TARGET.search(body)
            cur.insns.append(Insn(addr, body, op, tuple(chain), t.group(1) if t else None))
    return funcs


def find_function(funcs: list[Function], *needles: str) -> Function:
    hits = [f for f in funcs if all(n in f.name for n in needles)]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} functions match {needles}: {[f.name for f in hits]}")
    return hits[0]


def loops(func: Function) -> list[tuple[int, int]]:
    """(first, last) addresses of each loop: a conditional branch back to a label at or before
    it. Unconditional backward branches are left out: ptxas ends loops with a conditional
    back edge, and an unconditional one is the return from an out-of-line block (an
    mbarrier spin, say) or the trap loop after EXIT."""
    out = []
    for i in func.insns:
        if (i.base == "BRA" and i.text.startswith("@") and i.target in func.labels
                and func.labels[i.target] <= i.addr):
            out.append((func.labels[i.target], i.addr))
    return sorted(out)


def body(func: Function, first: int, last: int) -> list[Insn]:
    return [i for i in func.insns if first <= i.addr <= last]


def census(insns: list[Insn]) -> Counter:
    """Instruction count by class (see CLASSES), plus 'total'."""
    c = Counter(classify(i.opcode) for i in insns)
    c["total"] = len(insns)
    return c


def source_line(insn: Insn, source: str = "") -> int:
    """The innermost line of ``insn``'s inlining chain in a file whose path contains
    ``source`` (0 when none): with the kernel's .cu, the line of the kernel that a header
    function (a conversion, an intrinsic) was inlined into."""
    return next((line for f, line in insn.lines if source in f), 0)


def by_line(insns: list[Insn], source: str = "") -> Counter:
    """Instruction count by source line (see source_line)."""
    return Counter(source_line(i, source) for i in insns)


def guarded_blocks(func: Function, first: int, last: int) -> list[tuple[int, int, int]]:
    """(branch address, target address, instructions skipped) of each forward conditional
    branch inside a loop body whose target is inside it: the blocks a static count includes
    but a run may skip."""
    out = []
    for i in body(func, first, last):
        if (i.base == "BRA" and i.text.startswith("@") and i.target in func.labels
                and i.addr < func.labels[i.target] <= last):
            n = sum(1 for j in func.insns if i.addr < j.addr < func.labels[i.target])
            out.append((i.addr, func.labels[i.target], n))
    return out


def unguarded(func: Function, first: int, last: int) -> list[Insn]:
    """A loop body less its guarded blocks (see guarded_blocks): what every trip runs."""
    skip = [(br, tgt) for br, tgt, _ in guarded_blocks(func, first, last)]
    return [i for i in body(func, first, last)
            if not any(br < i.addr < tgt for br, tgt in skip)]


def format_census(name: str, c: Counter, per: float = 1.0) -> str:
    keys = [k for k, _ in CLASSES if c.get(k)] + (["other"] if c.get("other") else [])
    cells = " ".join(f"{k}={c[k] / per:.1f}" if per != 1 else f"{k}={c[k]}" for k in keys)
    total = c["total"] / per if per != 1 else c["total"]
    return f"{name}: total={total:.1f} {cells}" if per != 1 else f"{name}: total={total} {cells}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass", help="nvdisasm -c -g -gi output")
    ap.add_argument("--function", action="append", default=[],
                    help="substring(s) of the mangled name that pick one function")
    ap.add_argument("--function-has", action="append", default=[])
    ap.add_argument("--lines", action="store_true", help="also a per-source-line count")
    ap.add_argument("--source", default=".cu", help="file (substring) --lines counts in")
    args = ap.parse_args(argv)
    with open(args.sass) as fh:
        funcs = parse(fh.read())
    func = find_function(funcs, *args.function, *args.function_has)
    print(f"{func.name}: {len(func.insns)} instructions")
    for first, last in loops(func):
        ins = body(func, first, last)
        print(format_census(f"loop {first:#06x}-{last:#06x}", census(ins)))
        blocks = guarded_blocks(func, first, last)
        if blocks:
            print(format_census("  every trip", census(unguarded(func, first, last))))
        for br, tgt, _ in blocks:
            inner = [i for i in func.insns if br < i.addr < tgt]
            print(format_census(f"  guarded {br:#06x}->{tgt:#06x}", census(inner)))
        if args.lines:
            for line, n in sorted(by_line(ins, args.source).items()):
                print(f"  line {line}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
