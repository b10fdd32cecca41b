"""A vLLM logits processor that makes a random-weight model emit a scripted token sequence.

Test-only: a tiny random model cannot choose to call a tool, so the engine is made to
sample the scripted ids (then the last one, EOS, forever). Everything else on the path, the
real engine, the detokenizer, the parsers and the gateway, runs for real.
The script is a JSON list of token ids in the file named by `SCRIPT_ENV`, or an object of
two such lists: "free" for requests without an output constraint, "constrained" for those
held to one (a JSON schema, a forced tool call).

A grammar's mask stays in force: where it forbids the scripted token, the processor steps
aside and the model samples what the grammar allows. So a constrained script comes out whole
only if the engine's grammar allows each of its tokens where it stands.
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
            scripts = json.load(script)
        self.free_script: list[int] = scripts["free"] if isinstance(scripts, dict) else scripts
        self.constrained_script: list[int] = (scripts["constrained"] if isinstance(scripts, dict)
                                              else scripts)
        # Batch row -> that request's script and its live list of output token ids.
        self.outputs: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def track(params: SamplingParams, prompt_ids: list[int] | None,
                  output_ids: list[int]) -> tuple[list[int], list[int]]:
            script = self.free_script if params.structured_outputs is None else self.constrained_script
            return script, output_ids

        process_dict_updates(self.outputs, batch_update, track)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (script, output_ids) in self.outputs.items():
            token = script[min(len(output_ids), len(script) - 1)]
            if logits[row, token] == float("-inf"):
                continue
            forced = torch.full_like(logits[row], float("-inf"))
            forced[token] = 0.0
            logits[row] = forced
        return logits
