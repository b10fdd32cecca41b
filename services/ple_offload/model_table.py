"""Whether a model needs the PLE service, and which table it serves (for `backport up`).

Stdlib only: the launcher imports this before any service starts."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from services.ple_offload.errors import TableFileError
from services.ple_offload.table_format import read_safetensors_header

logger = logging.getLogger(__name__)

# The architecture whose PLE layers the engine hook serves from the PLE service.
QWEN4_EXP_ARCHITECTURE = "Qwen4ExpForCausalLM"

# vLLM's Qwen4Exp names the table `<layer>.ple.ple_embedding.ngram_embedding.weight`, or
# `.shard_<i>.weight` row shards of it.
_TABLE_TENSOR = re.compile(r"^(?P<stem>.+\.ngram_embedding)(\.shard_\d+)?\.weight$")


@dataclass(frozen=True, slots=True)
class PleTable:
    """What `backport ple` is started with: `--table-path` and `--tensor-name`."""

    table_path: Path
    tensor_name: str | None


def is_qwen4_exp(model: Path) -> bool:
    """True for a local checkpoint whose config.json lists the Qwen4Exp architecture."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return QWEN4_EXP_ARCHITECTURE in config.get("architectures", [])


def ple_table_for_model(model: Path, table_path: Path | None) -> PleTable | None:
    """The table to serve for `model`, or None when it needs no PLE service: it is not a
    Qwen4Exp checkpoint, or no table was given and its safetensors hold none."""
    if not is_qwen4_exp(model):
        if table_path is not None:
            logger.warning("PLE table %s not served: %s is not a %s checkpoint", table_path,
                           model, QWEN4_EXP_ARCHITECTURE)
        return None
    source = table_path or model
    stems = _table_stems(source)
    if len(stems) > 1:
        raise TableFileError(f"{source} holds {len(stems)} PLE tables ({', '.join(sorted(stems))}); "
                             "one PLE service serves one table")
    if table_path is None and not stems:
        return None
    # A given file without the Qwen4Exp name leaves the choice to the service.
    return PleTable(source, stems.pop() if stems else None)


def _table_stems(path: Path) -> set[str]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return {match["stem"] for file in files if file.exists()
            for name in read_safetensors_header(file).tensors
            if (match := _TABLE_TENSOR.match(name))}
