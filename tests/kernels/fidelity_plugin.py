"""pytest plugin: the Ampere fidelity harness for the Triton kernels.

Load it with `-p tests.kernels.fidelity_plugin` (run pytest as `python -m pytest` from
the repository root so the `tests` package is importable at plugin-load time).

- `--gpu-arch sm80|sm86|sm89` on a CUDA machine: kernels are lowered with that arch's
  instruction set and a fresh Triton cache (`arch_fidelity.enable_arch_emulation`);
  each kernel test fails if a compiled kernel's shared memory exceeds the arch's
  per-block limit, and in sm80/sm86 mode on any fp8 torch matmul or fp8 PTX
  instruction. Everything runs on a green context of the target card's SMs
  (`card_limits.TARGET_SM_COUNTS`; the driver may round up) unless `--whole-card` is given.
- No CUDA: the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set here
  before any kernel module is imported) on small shapes; `--gpu-arch` then only labels.
- At the end a table is printed (and written as markdown to `--fidelity-report PATH`):
  kernel, arch, max error vs reference, shared memory, registers and spills (the target's
  build under `--gpu-arch`), and the spills of the card's own build, which the tests run.
  Under pytest-xdist each worker hands its figures to the controller, which prints one table.

Nothing heavy is imported unless a test under tests/kernels is collected.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

KERNEL_TESTS_DIR = Path(__file__).resolve().parent
KERNEL_PACKAGE = "services.engine.backport.kernels"
GPU_ARCHS = ("sm80", "sm86", "sm89")
WORKER_OUTPUT_KEY = "kernel_fidelity"


@dataclass
class _HarnessState:
    arch: str | None = None
    report_path: str | None = None
    is_prepared: bool = False
    is_interpreter: bool = False
    device: str = "cpu"
    whole_card: bool = False
    sm_share: Any = None  # arch_fidelity.SmShare while the target's SM count is held
    max_errors: dict[str, float] = field(default_factory=dict)
    # CUDA C++ kernels (not in Triton's compile reports): name -> table row fields.
    cuda_resources: dict[str, dict[str, int]] = field(default_factory=dict)
    over_limit: set[str] = field(default_factory=set)
    # The figures of pytest-xdist's workers, on its controller.
    worker_figures: list[FidelityFigures] = field(default_factory=list)


_state = _HarnessState()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernel fidelity")
    group.addoption(
        "--gpu-arch",
        choices=GPU_ARCHS,
        default=None,
        help="compile Triton kernels with this arch's instruction set and limits",
    )
    group.addoption(
        "--fidelity-report",
        default=None,
        metavar="PATH",
        help="also write the kernel fidelity table as markdown to PATH",
    )
    group.addoption(
        "--whole-card",
        action="store_true",
        help="with --gpu-arch, run on all of the card's SMs, not the target card's count",
    )


def pytest_configure(config: pytest.Config) -> None:
    _state.arch = config.getoption("--gpu-arch")
    _state.report_path = config.getoption("--fidelity-report")
    _state.whole_card = config.getoption("--whole-card")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _state.sm_share is not None:
        _state.sm_share.release()
        _state.sm_share = None


def _is_kernel_test_path(path: Path) -> bool:
    return KERNEL_TESTS_DIR == path or KERNEL_TESTS_DIR in path.resolve().parents


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> None:
    # Runs before the test module is imported, so the backend can still be chosen.
    if _is_kernel_test_path(file_path) and file_path.suffix == ".py":
        _prepare_backend()


def _prepare_backend() -> None:
    if _state.is_prepared:
        return
    _state.is_prepared = True
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    _state.is_interpreter = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    _state.device = "cpu" if _state.is_interpreter else "cuda"
    if _state.arch is not None and not _state.is_interpreter:
        from services.engine.backport.kernels.arch_fidelity import enable_arch_emulation

        enable_arch_emulation(_state.arch, tempfile.mkdtemp(prefix=f"triton-cache-{_state.arch}-"))
        if not _state.whole_card:
            _hold_target_sm_count(_state.arch)


def _hold_target_sm_count(arch: str) -> None:
    """Launches, and the split rules that plan them, see the target card's SMs."""
    import torch

    from services.engine.backport.kernels.arch_fidelity import hold_sm_count
    from services.engine.backport.kernels.card_limits import TARGET_SM_COUNTS

    target = TARGET_SM_COUNTS[arch]
    if target >= torch.cuda.get_device_properties().multi_processor_count:
        return  # a card of the target's SMs or fewer runs whole
    try:
        _state.sm_share = hold_sm_count(target)
    except RuntimeError as error:
        raise pytest.UsageError(f"{error}; pass --whole-card to run on all SMs") from error


def _kernel_modules() -> list[Any]:
    package = importlib.import_module(KERNEL_PACKAGE)
    return [
        importlib.import_module(f"{KERNEL_PACKAGE}.{info.name}")
        for info in pkgutil.iter_modules(package.__path__)
    ]


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """ "cuda" when kernels compile for a GPU, "cpu" under the interpreter."""
    _prepare_backend()
    return _state.device


@pytest.fixture(scope="session")
def is_interpreter() -> bool:
    _prepare_backend()
    return _state.is_interpreter


@pytest.fixture(scope="session")
def gpu_arch() -> str | None:
    return _state.arch


@pytest.fixture(scope="session")
def held_sm_count() -> int | None:
    """The SMs the kernels run on when the harness holds the target card's count, else None."""
    _prepare_backend()
    return None if _state.sm_share is None else _state.sm_share.sm_count


@pytest.fixture
def record_max_error() -> Callable[[str, float], None]:
    """Record a kernel's error against its reference for the fidelity table."""

    def record(kernel_name: str, error: float) -> None:
        _state.max_errors[kernel_name] = max(error, _state.max_errors.get(kernel_name, 0.0))

    return record


@pytest.fixture
def record_cuda_kernel() -> Callable[[str, int, int, int], None]:
    """Record a build of a CUDA C++ kernel (shared memory, registers, spilled bytes) for the
    table; several builds of one kernel count as its variants, with the largest figures."""

    def record(kernel_name: str, shared_bytes: int, registers: int, spill_bytes: int) -> None:
        # The driver's build for the card present: the card's spills too.
        _add_variant(_state.cuda_resources, kernel_name, shared_bytes, registers, spill_bytes,
                     spill_bytes)

    return record


def _add_variant(rows: dict[str, dict[str, Any]], name: str, shared_bytes: int,
                 registers: int, spill_bytes: int, card_spill_bytes: int) -> None:
    """Counts one compiled variant of kernel `name` in `rows`, keeping the largest figures."""
    row = rows.setdefault(name, {"variants": 0, "shared": 0, "registers": 0, "spills": 0,
                                 "card spills": 0})
    row["variants"] += 1
    row["shared"] = max(row["shared"], shared_bytes)
    row["registers"] = max(row["registers"], registers)
    row["spills"] = max(row["spills"], spill_bytes)
    row["card spills"] = max(row["card spills"], card_spill_bytes)


@pytest.fixture(autouse=True)
def _kernel_fidelity_checks(request: pytest.FixtureRequest) -> Iterator[None]:
    if not _is_kernel_test_path(Path(str(request.node.path))) or _state.is_interpreter:
        yield
        return
    from services.engine.backport.kernels.arch_fidelity import (
        SHARED_MEMORY_LIMIT_BYTES,
        Fp8MatmulGuard,
        compiled_kernel_reports,
    )
    from services.engine.backport.kernels.card_limits import ARCHS_WITHOUT_FP8

    if _state.arch in ARCHS_WITHOUT_FP8:
        with Fp8MatmulGuard():
            yield
    else:
        yield
    if _state.arch is None:
        return
    limit = SHARED_MEMORY_LIMIT_BYTES[_state.arch]
    offenders = {
        r.name: r.shared_bytes
        for r in compiled_kernel_reports(_kernel_modules())
        if r.shared_bytes > limit and r.name not in _state.over_limit
    }
    _state.over_limit.update(offenders)
    if offenders:
        pytest.fail(f"shared memory over the {_state.arch} limit of {limit} B: {offenders}")


@dataclass
class FidelityFigures:
    """What the table shows, gathered in one test process."""

    arch_label: str
    max_errors: dict[str, float]
    # Kernel name -> the largest shared bytes, registers and spills of its builds (_add_variant).
    resources: dict[str, dict[str, int]]

    def merged(self, other: FidelityFigures) -> FidelityFigures:
        """Both processes' figures, the worst of each."""
        max_errors = dict(self.max_errors)
        for name, error in other.max_errors.items():
            max_errors[name] = max(error, max_errors.get(name, 0.0))
        resources = {name: dict(row) for name, row in self.resources.items()}
        for name, row in other.resources.items():
            mine = resources.setdefault(name, {})
            for key, value in row.items():
                mine[key] = max(value, mine.get(key, 0))
        return FidelityFigures(self.arch_label, max_errors, resources)


def own_figures() -> FidelityFigures:
    rows: dict[str, dict[str, Any]] = {}
    if not _state.is_interpreter and _state.is_prepared:
        from services.engine.backport.kernels.arch_fidelity import compiled_kernel_reports

        for report in compiled_kernel_reports(_kernel_modules()):
            _add_variant(rows, report.name, report.shared_bytes, report.registers,
                         report.spills, report.card_spills)
    rows.update(_state.cuda_resources)
    if _state.is_interpreter:
        arch_label = f"{_state.arch or 'any'} (interpreter)"
    else:
        arch_label = _state.arch or "native"
        if _state.sm_share is not None:
            share = _state.sm_share
            arch_label += f" ({share.sm_count} of {share.card_sm_count} SMs)"
    return FidelityFigures(arch_label, dict(_state.max_errors), rows)


def fidelity_table(figures: FidelityFigures) -> list[dict[str, str]]:
    """One row per kernel: compiled resources (worst specialization) and max error."""
    rows = dict(figures.resources)
    for name in figures.max_errors:
        rows.setdefault(name, {})
    limit = None
    if _state.arch is not None:
        from services.engine.backport.kernels.arch_fidelity import SHARED_MEMORY_LIMIT_BYTES

        limit = SHARED_MEMORY_LIMIT_BYTES[_state.arch]
    table = []
    for name in sorted(rows):
        row = rows[name]
        error = figures.max_errors.get(name)
        table.append(
            {
                "kernel": name,
                "arch": figures.arch_label,
                "max error vs reference": "-" if error is None else f"{error:.3g}",
                "shared B": str(row["shared"]) + (f" / {limit}" if limit else "")
                if "shared" in row
                else "-",
                "registers": str(row.get("registers", "-")),
                "spills": str(row.get("spills", "-")),
                # Emulated timings run the card's build, which may spill where the target's
                # does not.
                "spills, card's build": str(row.get("card spills", "-")),
                "variants": str(row.get("variants", "-")),
            }
        )
    return table


def _markdown(table: list[dict[str, str]]) -> str:
    header = list(table[0])
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in table]
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session: pytest.Session) -> None:
    # A pytest-xdist worker hands its figures to the controller, which prints the table.
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None and _state.is_prepared:
        worker_output[WORKER_OUTPUT_KEY] = dataclasses.asdict(own_figures())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    figures = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT_KEY)
    if figures is not None:
        _state.worker_figures.append(FidelityFigures(**figures))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    gathered = _state.worker_figures + ([own_figures()] if _state.is_prepared else [])
    if not gathered:
        return
    table = fidelity_table(functools.reduce(FidelityFigures.merged, gathered))
    if not table:
        return
    text = _markdown(table)
    terminalreporter.write_sep("=", "kernel fidelity")
    terminalreporter.write(text)
    if _state.report_path:
        Path(_state.report_path).write_text(text)
