"""One command for the whole kernel fidelity set, ending with the table.

    python -m tests.kernels.fidelity_report --gpu-arch sm80 [--report-file PATH] [pytest args]

Runs every test under tests/kernels with the fidelity plugin: on a CUDA card the kernels
compile with the arch's instruction set in a fresh Triton cache and the table gives each
kernel's max error vs reference, shared memory against the arch's limit, registers and
spills (the target's build) and the spills of the card's own build, which is what runs;
without CUDA the same tests run under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

# Kept in step with fidelity_plugin.GPU_ARCHS; importing the plugin here would stop
# pytest from rewriting its asserts.
GPU_ARCHS = ("sm80", "sm86", "sm89")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu-arch", choices=GPU_ARCHS, required=True)
    parser.add_argument("--report-file", default=None, help="also write the table as markdown here")
    args, pytest_args = parser.parse_known_args()
    command = [
        str(Path(__file__).resolve().parent),
        "-p",
        "tests.kernels.fidelity_plugin",
        "--gpu-arch",
        args.gpu_arch,
        "-q",
        "-rs",
        *pytest_args,
    ]
    if args.report_file:
        command += ["--fidelity-report", args.report_file]
    return int(pytest.main(command))


if __name__ == "__main__":
    sys.exit(main())
