"""Which GPUs each engine that `backport up` starts may use.

Without a choice, every engine process sees every GPU and vLLM puts each on the first: two
engines on one GPU, where the second runs out of memory. So each engine gets its own
`CUDA_VISIBLE_DEVICES`, a disjoint slice of the GPUs the launcher itself may use.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping

from services.mesh.errors import ServiceStartError

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
NVIDIA_SMI_TIMEOUT_S = 10.0


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` names them: that variable's
    list where it is set, else every GPU the driver lists; none where no driver answers."""
    listed = environ.get(VISIBLE_DEVICES_ENV)
    if listed is not None:
        return [device.strip() for device in listed.split(",") if device.strip()]
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if query.returncode != 0:
        return []
    return [line.strip() for line in query.stdout.splitlines() if line.strip()]


def split_gpus(gpus: list[str], num_engines: int, gpus_per_engine: int) -> list[list[str]] | None:
    """Each engine's GPUs, in order; None where there are no GPUs (a CPU build's engines).
    Refused where the engines need more GPUs than there are."""
    if not gpus:
        return None
    needed = num_engines * gpus_per_engine
    if needed > len(gpus):
        raise ServiceStartError(
            f"--engines {num_engines} with --tensor-parallel-size {gpus_per_engine} needs "
            f"{needed} GPUs; this machine shows {len(gpus)}: {','.join(gpus)}")
    return [gpus[index * gpus_per_engine:(index + 1) * gpus_per_engine]
            for index in range(num_engines)]
