"""A vLLM logits processor that makes a random-weight model emit a scripted token sequence.

Test-only: a tiny random model cannot choose to call a tool, so the engine is made to
sample the scripted ids (then the last one, EOS, forever). Everything else on the path, the
real engine, the detokenizer, the parsers and the gateway, runs for real.
The script is a JSON list of token ids in the file named by `SCRIPT_ENV`.
"""

from __future__ import annotations

import json
import os

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

SCRIPT_ENV = "BACKPORT_TEST_SCRIPTED_OUTPUT"


class ScriptedOutputLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        with open(os.environ[SCRIPT_ENV]) as script:
            self.script: list[int] = json.load(script)
        # Batch row -> that request's live list of output token ids.
        self.outputs: dict[int, list[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def track(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> list[int]:
            return output_ids

        process_dict_updates(self.outputs, batch_update, track)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, output_ids in self.outputs.items():
            position = min(len(output_ids), len(self.script) - 1)
            forced = torch.full_like(logits[row], float("-inf"))
            forced[self.script[position]] = 0.0
            logits[row] = forced
        return logits
