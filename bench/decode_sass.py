"""What one step of the sparse MLA decode costs in instructions, read without a GPU.

    python bench/decode_sass.py [--arch sm80] [--block-n 32] [--num-warps 4] [--heads 16]
                                [--maxnreg N]

Compiles `_sparse_mla_decode_kernel` for the arch as the launcher specializes it (every
pointer and stride divisible by 16, with the window and compressed lists, lengths and
sink, several splits), assembles it with the `ptxas` in Triton's wheel and disassembles
it with its `nvdisasm`, then prints registers, spills, shared memory and, for each loop
of the kernel (one per slot list), its SASS instructions per warp per step by opcode
and its barriers. A step's instructions x warps per SM / 4 schedulers is the issue
time; measured time far above it means stalls, not work.

Codegen differs between Triton releases: run it with the Triton the engines use (the
H200 image has 3.6: `pip download triton==3.6.0 --no-deps` and
`pip install --no-deps --target DIR`, then `PYTHONPATH=DIR`).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.engine.backport.kernels import sparse_mla_decode as decode  # noqa: E402

ARCHES = {"sm80": 80, "sm86": 86, "sm89": 89}
POINTER_TYPES = {
    "q_ptr": "*bf16",
    "cache_ptr": "*u8",
    "slots_ptr": "*i32",
    "lengths_ptr": "*i32",
    "extra_cache_ptr": "*u8",
    "extra_slots_ptr": "*i32",
    "extra_lengths_ptr": "*i32",
    "sink_ptr": "*fp32",
    "out_ptr": "*bf16",
    "lse_ptr": "*fp32",
    "partial_out_ptr": "*fp32",
    "partial_lse_ptr": "*fp32",
}
# Integer arguments that are not multiples of 16 in general (sizes; the lse partials'
# strides, `stride_pl_*`, are handled by name): no divisibility hint for them.
UNALIGNED_INTS = {"num_heads", "list_width", "extra_list_width", "split_len", "extra_split_len"}
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")


@dataclass(frozen=True)
class Loop:
    first: int
    last: int
    opcodes: collections.Counter[str]

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def compile_decode(arch: str, block_n: int, num_warps: int, heads: int, maxnreg: int | None):
    kernel = decode._sparse_mla_decode_kernel
    constexprs = dict(
        BLOCK_SIZE=64,
        EXTRA_BLOCK_SIZE=64,
        HAS_LENGTHS=True,
        HAS_EXTRA=True,
        HAS_EXTRA_LENGTHS=True,
        HAS_SINK=True,
        IS_SINGLE_SPLIT=False,
        HEADS_PER_PROGRAM=heads,
        BLOCK_N=block_n,
        DOT_DTYPE=tl.bfloat16,
        FAST_DEQUANT=True,
    )
    signature, attributes = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "qk_scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = POINTER_TYPES.get(name, "i32")
            if name not in UNALIGNED_INTS and not name.startswith("stride_pl"):
                attributes[(index,)] = [["tt.divisibility", 16]]
    options = {"num_warps": num_warps, "num_stages": 1}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    source = ASTSource(kernel, signature, constexprs, attributes)
    return triton.compile(source, target=GPUTarget("cuda", ARCHES[arch], 32), options=options)


def assemble(ptx: str, arch: str) -> tuple[str, str]:
    """(ptxas -v report, SASS listing) from the wheel's own tools."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as scratch:
        ptx_path, cubin_path = Path(scratch) / "k.ptx", Path(scratch) / "k.cubin"
        ptx_path.write_text(ptx)
        report = subprocess.run(
            [tools / "ptxas", f"-arch=sm_{ARCHES[arch]}", "-v", ptx_path, "-o", cubin_path],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [tools / "nvdisasm", "-c", cubin_path], capture_output=True, text=True, check=True
        ).stdout
    return report, sass


def loops(sass: str) -> list[Loop]:
    """Each backward branch's body, with its instructions counted by opcode."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if label := LABEL.match(line):
            labels[label.group(1)] = len(instructions)
        elif instruction := INSTRUCTION.search(line):
            instructions.append(instruction.group(1))
    found = []
    for index, text in enumerate(instructions):
        target = BRANCH_TARGET.search(text)
        if target and labels.get(target.group(1), index) < index:
            first = labels[target.group(1)]
            body = instructions[first : index + 1]
            opcodes = collections.Counter(
                re.sub(r"^@!?U?P\w+\s+", "", line).split()[0].split(".")[0] for line in body
            )
            found.append(Loop(first, index, opcodes))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHES), default="sm80")
    parser.add_argument("--block-n", type=int, default=decode.DEFAULT_BLOCK_N)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--heads", type=int, default=decode.DEFAULT_HEADS_PER_PROGRAM)
    parser.add_argument("--maxnreg", type=int, default=None, help="cap registers a thread")
    args = parser.parse_args()

    compiled = compile_decode(args.arch, args.block_n, args.num_warps, args.heads, args.maxnreg)
    report, sass = assemble(compiled.asm["ptx"], args.arch)
    usage = [line.split("info    : ")[-1] for line in report.splitlines() if "Used" in line]
    print(f"triton {triton.__version__}, {args.arch}, block_n={args.block_n}, "
          f"num_warps={args.num_warps}, heads={args.heads}, maxnreg={args.maxnreg}")
    print(f"shared memory {compiled.metadata.shared} B; {'; '.join(usage)}")
    for number, loop in enumerate(loops(sass), start=1):
        top = ", ".join(f"{op} {count}" for op, count in loop.opcodes.most_common(16))
        print(f"loop {number}: {loop.size} instructions a warp a step, "
              f"{loop.opcodes['BAR']} barriers; {top}")


if __name__ == "__main__":
    main()
