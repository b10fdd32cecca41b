"""vLLM's AsyncLLM behind a token-ids-only interface, with no transport code."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput
from vllm.platforms import CpuArchEnum, current_platform
from vllm.reasoning import ReasoningParserManager

from services.engine.backport.engine_core_watch import SERVICE_PID_ENV
from services.engine.backport.ple.activation import ADDRESS_ENV as PLE_ADDRESS_ENV
from services.engine.kv_events import ipc_socket_path
from services.engine.kv_transfer import engine_kv_args
from services.engine.llvmlite_in_forked_core import give_llvmlites_library_an_empty_namespace
from services.engine.settings import EngineSettings
from services.mesh.errors import ServiceStartError

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GIB = 2.0
# Where vLLM binds its processes' ZMQ sockets (socket files named by uuid); read when each
# socket is made, and inherited by the engine-core and worker processes.
RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"
_RPC_BASE_PATH = os.environ.get(RPC_BASE_PATH_ENV)  # the setting before any engine's own
# How vLLM starts its engine core and workers: fork (its default) or spawn.
MULTIPROC_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
# The seed's model families: their CPU paths (vLLM's and ours, such as DeepSeek-V4's mHC
# mixing) take bf16 only.
BF16_ONLY_MODEL_TYPES = frozenset({"deepseek_v4", "glm5_next", "qwen4_exp"})
# vLLM's CPU OpenMP thread binding ("nobind" turns it off), and the switch that, off, lets
# its CPU platform keep a single worker in the engine core process.
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# vLLM's own server bounds each logit bias to this range (OpenAI's); unbounded, an infinite
# bias on two tokens turns every probability into NaN and the sampled tokens into noise.
MAX_LOGIT_BIAS = 100.0
# Each kind of output constraint as an error message names it.
CONSTRAINT_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint",
                         "regex": "regex", "choice": "choices", "grammar": "grammar"}


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message is safe to show the client. `field`
    is the GenerateRequest field at fault, as a path, where it is known."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class InvalidConstraintError(InvalidRequestError):
    """The request's output constraint is what cannot be served."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="sampling.structured_output")


class RequestFailedError(RuntimeError):
    """vLLM ended the request with its `error` finish reason, which its own server turns into
    a 500: a constraint that passed its checks but does not compile in the engine core, a KV
    load that failed. The engine core's log says which; the message is safe to show."""


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """The engine-independent sampling controls; None means the model's default."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Set: each prompt token's logprob and rank, plus this many top alternatives.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    constraint: OutputConstraint | None = None
    # Set: only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated, tokenized by vLLM.
    bad_words: list[str] = field(default_factory=list)
    # Set: the reasoning is ended for the model after this many tokens.
    thinking_token_budget: int | None = None


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """A structured-output constraint; `kind` names the `StructuredOutputsParams` field."""

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    value: str | bool | list[str]
    # The output starts inside the model's reasoning; the constraint holds from its end.
    after_reasoning: bool = False

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**{self.kind: self.value})


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's logprob and vocabulary rank (1 is the most likely), and the top alternatives
    at its position as (token id, logprob, rank), most likely first; they may include it."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float, int]]


@dataclass(slots=True)
class ChoiceUpdate:
    """New tokens of one choice. Counts are running totals; `finish_reason` is set once, last.

    The token that ended the choice (EOS or a stop token) is left out of `token_ids` and
    `logprobs`, as it is no part of the choice's text; `stopping_token_id` and
    `stopping_token_logprob` hold it."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    finish_reason: str | None = None
    # vLLM's `stop_reason` when a stop token (not EOS) ended the choice.
    stop_token_id: int | None = None
    stopping_token_id: int | None = None
    stopping_token_logprob: TokenLogprob | None = None
    # Once a call, when asked for: the prompt's tokens from the second on, scored.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    served_model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: str
    architecture: str
    # The model's generation_config defaults; None where it sets none.
    default_temperature: float | None = None
    default_top_p: float | None = None


@dataclass(slots=True)
class Loads:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


def spawn_vllm_processes_for_ple(environ: MutableMapping[str, str] = os.environ) -> None:
    """Where the PLE hook is on, vLLM starts its engine core and workers by spawn, not fork.

    The hook's client makes gRPC calls inside those processes, which vLLM forks from the engine
    service by default. A forked child's calls hang on the grpc the service set up for
    polling-thread I/O (services/mesh/grpc_io.py); a spawned child sets up its own, from the
    environment it inherits.
    """
    if environ.get(PLE_ADDRESS_ENV):
        environ[MULTIPROC_METHOD_ENV] = "spawn"


def unbind_cpu_threads_on_two_cores(settings: EngineSettings,
                                    environ: MutableMapping[str, str] = os.environ,
                                    usable_cpus: int | None = None) -> None:
    """On a machine of two usable cores or fewer, vLLM's OpenMP threads run unbound.

    vLLM's "auto" binding keeps a core for its engine core's scheduler and binds one thread to
    each of the others: one thread of two cores. Unbound, torch's threads use both. The
    embedded model on two cores (`make run`): 23 against 17 tokens a second for one stream,
    72 against 49 for four. Not measured on more cores, where "auto" binds more threads; an
    operator's setting is left as it is.
    """
    usable = usable_cpus if usable_cpus is not None else len(os.sched_getaffinity(0))
    if (current_platform.is_cpu() and THREADS_BIND_ENV not in environ
            and settings.tensor_parallel_size == 1 and usable <= 2):
        environ[THREADS_BIND_ENV] = "nobind"


def cpu_worker_in_engine_core(settings: EngineSettings,
                              environ: MutableMapping[str, str] = os.environ) -> None:
    """On the CPU with OpenMP thread binding off, vLLM's one worker runs inside its engine core
    process rather than in a process of its own: one import of vLLM fewer (about 10 s of an
    engine's start on two cores) and that process's memory.

    vLLM's CPU platform always gives its worker a process of its own, so that the worker can
    set its OpenMP thread binding before OpenMP starts. With binding off there is nothing to
    set, and with vLLM's multiprocessing switch off the platform keeps the single-process
    executor. AsyncLLM reads no other part of that switch: its engine core is still a process
    of its own. A switch the operator set is left as it is.
    """
    if (current_platform.is_cpu() and environ.get(THREADS_BIND_ENV) == "nobind"
            and settings.tensor_parallel_size == 1 and MULTIPROCESSING_ENV not in environ):
        environ[MULTIPROCESSING_ENV] = "0"


def fork_an_engine_core_that_holds_its_worker(method_chosen: str | None,
                                              environ: MutableMapping[str, str] = os.environ) -> None:
    """Where vLLM's one CPU worker runs inside its engine core (`cpu_worker_in_engine_core`),
    the engine core is forked from the engine service rather than spawned: it skips a second
    import of vLLM, an engine's start 19 s against 29 on two cores.

    vLLM's CPU platform sets spawn as it builds the config, so that each worker binds its OpenMP
    threads in a fresh process; with binding off there is nothing to bind. `method_chosen` is
    the start method set before the config was built (the operator's, or the PLE hook's spawn),
    which stays.
    """
    if (method_chosen is None and current_platform.is_cpu()
            and environ.get(THREADS_BIND_ENV) == "nobind" and environ.get(MULTIPROCESSING_ENV) == "0"):
        environ[MULTIPROC_METHOD_ENV] = "fork"


def start_async_llm(args: AsyncEngineArgs,
                    stat_loggers: list[Callable[..., StatLoggerBase]] | None = None) -> AsyncLLM:
    """`AsyncLLM.from_engine_args`, with the engine core forked where
    `fork_an_engine_core_that_holds_its_worker` says so."""
    method_chosen = os.environ.get(MULTIPROC_METHOD_ENV)
    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    fork_an_engine_core_that_holds_its_worker(method_chosen)
    give_llvmlites_library_an_empty_namespace()
    return AsyncLLM.from_vllm_config(config, stat_loggers=stat_loggers,
                                     enable_log_requests=args.enable_log_requests,
                                     disable_log_stats=args.disable_log_stats)


def engine_dtype(settings: EngineSettings) -> str:
    """The dtype vLLM is given: `--dtype`, except that "auto" is float32 for an unquantized
    checkpoint on an x86 CPU without AVX512-BF16.

    vLLM's CPU platform takes bf16 for native on every x86 CPU. Without AVX512-BF16, torch
    emulates bf16 matmuls: on one core of an AVX2 machine, 1 GFLOPS against float32's 53, and
    the embedded model's 1,500-token prefill takes 45 s against 10. A quantized checkpoint, and
    the families in BF16_ONLY_MODEL_TYPES, keep vLLM's choice, which their kernels are written for.
    """
    if (settings.dtype != "auto" or not current_platform.is_cpu()
            or current_platform.get_cpu_architecture() != CpuArchEnum.X86
            or torch.cpu._is_avx512_bf16_supported()):
        return settings.dtype
    try:
        config = json.loads((Path(settings.model) / "config.json").read_text())
    except (OSError, ValueError):
        return settings.dtype  # a hub id, or no readable config: vLLM decides
    if "quantization_config" in config or config.get("model_type") in BF16_ONLY_MODEL_TYPES:
        return settings.dtype
    logger.info("this CPU has no AVX512-BF16, where bf16 matmuls are emulated: the engine runs "
                "in float32 (--dtype bfloat16 keeps bf16)")
    return "float32"


def vllm_engine_args(settings: EngineSettings) -> AsyncEngineArgs:
    """vLLM's engine arguments from the settings, `--vllm-args` last. A `--vllm-args` name that
    vLLM does not know, or that the service sets itself, is refused before the model loads."""
    s = settings
    kv_cache_gib = s.kv_cache_memory_gib
    if kv_cache_gib is None and current_platform.is_cpu():
        # vLLM's CPU default reserves 90% of the node's memory and refuses to start when
        # anything else on the machine holds more than a tenth of it.
        kv_cache_gib = CPU_DEFAULT_KV_CACHE_GIB
    ours = dict(
        model=s.model, served_model_name=s.served_model_name, max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs, scheduling_policy=s.scheduling_policy, dtype=engine_dtype(s),
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.enable_prefix_caching, tensor_parallel_size=s.tensor_parallel_size,
        gpu_memory_utilization=s.gpu_memory_utilization, trust_remote_code=s.trust_remote_code,
        kv_cache_memory_bytes=int(kv_cache_gib * 2**30) if kv_cache_gib else None,
        logits_processors=list(s.logits_processors) or None,
        reasoning_parser=_known_reasoning_parser(s.reasoning_parser),
        **engine_kv_args(s.model, s.kv_service, s.kv_transfer_mode, s.kv_chunk_size_tokens,
                         s.kv_events_endpoint))
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for name in s.vllm_args:
        if name not in known:
            raise ServiceStartError(f"--vllm-args: {name!r} is not one of vLLM's engine "
                                    "arguments (their Python names, as `vllm serve --help` "
                                    "lists them with `_` for `-`)")
        if name in EngineSettings.model_fields:
            raise ServiceStartError(f"--vllm-args: {name!r} has its own flag, --"
                                    f"{name.replace('_', '-')}")
        if name in ours:
            raise ServiceStartError(f"--vllm-args: {name!r} is set by the engine service "
                                    "from its other settings")
    return AsyncEngineArgs(**ours, **s.vllm_args)


def _known_reasoning_parser(name: str | None) -> str:
    """The name as vLLM's engine arguments take it ("" for none); an unknown name is refused
    here, where vLLM would find it only in the engine core, after the model load."""
    if name is None:
        return ""
    if name not in ReasoningParserManager.list_registered():
        raise ServiceStartError(f"--reasoning-parser: {name!r} is not one of vLLM's reasoning "
                                f"parsers ({', '.join(sorted(ReasoningParserManager.list_registered()))})")
    return name


class VllmEngine:
    """One AsyncLLM; `generate` yields `ChoiceUpdate`s and aborts the request when closed early."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self._llm: AsyncLLM | None = None
        self._scheduler_loads = Loads()
        self._num_sequences_in_flight = 0
        # vLLM aborts by the caller's id every request that carries it: two requests under one
        # id would share their aborts.
        self._request_ids_in_flight: set[str] = set()
        self._defaults: dict[str, Any] = {}
        self._ipc_dir: str | None = None
        self.info: ModelInfo | None = None

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("engine not started")
        return self._llm

    def start(self) -> None:
        # Before the arguments, whose making loads vLLM's plugins: the engine-service watch
        # reads it there (services/engine/backport/engine_core_watch.py).
        os.environ[SERVICE_PID_ENV] = str(os.getpid())
        args = vllm_engine_args(self.settings)
        s = self.settings
        # vLLM leaves its socket files behind when it stops, even on a clean shutdown (7 an
        # engine, measured): a directory of this engine's own holds them, removed at shutdown.
        self._ipc_dir = tempfile.mkdtemp(prefix="backport-engine-ipc-", dir=_RPC_BASE_PATH)
        os.environ[RPC_BASE_PATH_ENV] = self._ipc_dir
        spawn_vllm_processes_for_ple()
        unbind_cpu_threads_on_two_cores(s)
        cpu_worker_in_engine_core(s)
        try:
            self._llm = start_async_llm(args, stat_loggers=[self._stat_logger_factory])
        except BaseException:
            self.shutdown()
            raise
        model_config = self._llm.model_config
        self._defaults = model_config.get_diff_sampling_param()
        tokenizer = self._llm.get_tokenizer()
        eos_ids = {tokenizer.eos_token_id}
        for source in (model_config.hf_config.eos_token_id,
                       model_config.try_get_generation_config().get("eos_token_id")):
            eos_ids |= set(source) if isinstance(source, list) else {source}
        self.info = ModelInfo(
            served_model_name=s.served_model_name or Path(s.model).name,
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            eos_token_ids=sorted(i for i in eos_ids if i is not None),
            tokenizer=str(model_config.tokenizer),
            architecture=(model_config.architectures or ["unknown"])[0],
            default_temperature=self._defaults.get("temperature"),
            default_top_p=self._defaults.get("top_p"))

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        endpoint = self.settings.kv_events_endpoint
        socket_path = ipc_socket_path(endpoint) if endpoint is not None else None
        if socket_path is not None:
            # vLLM's KV-event publisher binds this socket file and leaves it when it stops.
            socket_path.unlink(missing_ok=True)

    @property
    def is_healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def loads(self) -> Loads:
        # Scheduler stats arrive only while the engine steps; once the last request is gone
        # they are stale, and the sequences of the open streams are the truth (vLLM runs and
        # counts each of a request's n choices as a request of its own).
        in_flight = self._num_sequences_in_flight
        if in_flight == 0:
            return Loads(kv_cache_usage=self._scheduler_loads.kv_cache_usage)
        return Loads(num_running=min(self._scheduler_loads.num_running, in_flight),
                     num_waiting=min(self._scheduler_loads.num_waiting, in_flight),
                     kv_cache_usage=self._scheduler_loads.kv_cache_usage)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def abort_choices(self, request_id: str, indexes: set[int]) -> None:
        """Aborts these choices of a request; its stream goes on with the others.

        vLLM runs each choice of an n > 1 request as a child request under an internal id,
        and aborts by the caller's id only all of them together. The children are found
        through its output processor's bookkeeping (vLLM 0.32), which names each child's
        index; `tests/test_engine_service.py` holds this to the installed vLLM."""
        processor = self.llm.output_processor
        children = [internal_id for internal_id in processor.external_req_ids.get(request_id, ())
                    if (state := processor.request_states.get(internal_id)) is not None
                    and state.request_index in indexes]
        if children:
            await self.llm.abort(children, internal=True)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingRequest, *,
                       cache_salt: str | None = None, priority: int = 0
                       ) -> AsyncIterator[ChoiceUpdate]:
        """`cache_salt`: the prompt's cached KV is shared only with requests of the same salt.
        `priority` counts under the priority scheduling policy only, as in vLLM."""
        assert self.info is not None
        if not prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids is empty")
        if len(prompt_token_ids) >= self.info.max_model_len:
            raise InvalidRequestError(
                f"prompt_token_ids has {len(prompt_token_ids)} tokens; the model's context of "
                f"{self.info.max_model_len} tokens takes at most {self.info.max_model_len - 1}, "
                "to leave room for an output token")
        # vLLM's own check names no field: a client could not tell the prompt from a sampling
        # field that also holds token ids.
        for token_id in (min(prompt_token_ids), max(prompt_token_ids)):
            if not 0 <= token_id < self.info.vocab_size:
                raise InvalidRequestError(
                    f"prompt_token_ids holds token id {token_id}, out of vocabulary (the "
                    f"model's token ids are 0 to {self.info.vocab_size - 1})")
        params = self._sampling_params(sampling, len(prompt_token_ids))
        reasoning_ended = self._reasoning_ended(sampling.constraint)
        if request_id in self._request_ids_in_flight:
            raise InvalidRequestError(
                f"request_id {request_id!r} is already in flight on this engine; an id is free "
                "again once its request has finished or been cancelled")
        self._request_ids_in_flight.add(request_id)
        holds_request_id = True
        self._num_sequences_in_flight += params.n
        completion_tokens: dict[int, int] = {}
        # vLLM hands the prompt's logprobs over once, with the output that ends the prefill.
        unsent_prompt_logprobs: list[TokenLogprob] | None = None
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids)
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        try:
            # Closed on the way out: a choice that failed ends the call, and vLLM aborts the
            # other choices only when its stream is closed.
            async with aclosing(self.llm.generate(prompt, params, request_id, priority=priority,
                                                  reasoning_ended=reasoning_ended)) as stream:
                async for output in stream:
                    if output.finished:
                        # A client that has the request's last output may reuse its id at once,
                        # before this generator resumes to end.
                        self._request_ids_in_flight.discard(request_id)
                        holds_request_id = False
                    if output.prompt_logprobs and sampling.prompt_logprobs is not None:
                        unsent_prompt_logprobs = _prompt_logprobs(
                            prompt_token_ids, output.prompt_logprobs, sampling.prompt_logprobs)
                    for completion in output.outputs:
                        if completion.finish_reason == "error":
                            # Passed on as a finish reason, the client took it for a choice
                            # that ended well, empty or cut short.
                            raise RequestFailedError(
                                f"vLLM failed choice {completion.index} of the request in its "
                                "engine core (an output constraint that does not compile there, "
                                "or KV that failed to load)")
                        done = completion_tokens.get(completion.index, 0) + len(completion.token_ids)
                        completion_tokens[completion.index] = done
                        update = _choice_update(completion, len(prompt_token_ids), done,
                                                output.num_cached_tokens or 0,
                                                sampling.logprobs or 0)
                        update.prompt_logprobs, unsent_prompt_logprobs = unsent_prompt_logprobs, None
                        yield update
        except VLLMClientError as error:
            # vLLM's own verdict on the request (a token id outside the vocabulary, a
            # logprobs count past its limit, a constraint that does not compile); it wraps
            # anything else in EngineGenerateError.
            if sampling.constraint is not None:
                await self._check_constraint(sampling.constraint)
            raise InvalidRequestError(str(error)) from error
        finally:
            self._num_sequences_in_flight -= params.n
            if holds_request_id:
                self._request_ids_in_flight.discard(request_id)

    def _reasoning_ended(self, constraint: OutputConstraint | None) -> bool | None:
        """vLLM's `reasoning_ended` for a constrained request: whether the constraint holds from
        the first token. Told, not left to vLLM's reading of the prompt, so that the engine and
        the gateway's output parser agree on where the reasoning is."""
        if constraint is None:
            return None
        if constraint.after_reasoning and not self.settings.reasoning_parser:
            raise InvalidConstraintError(
                "a constrained output after the model's reasoning needs the engine's reasoning "
                "parser, which finds where the reasoning ends (`backport engine "
                '--reasoning-parser`); or turn thinking off (reasoning_effort: "none")')
        return not constraint.after_reasoning

    async def _check_constraint(self, constraint: OutputConstraint) -> None:
        """Raises `InvalidConstraintError` if the constraint alone fails vLLM's check. vLLM
        checks it among the request's other fields, and its errors name none of them; so a
        request vLLM refused is checked again here, to tell the constraint's fault."""
        vllm_config = self.llm.vllm_config
        try:
            alone = SamplingParams(structured_outputs=constraint.params())
            # Off the event loop, as vLLM checks it: compiling a regex may take seconds.
            await asyncio.to_thread(alone.verify, vllm_config.model_config,
                                    vllm_config.speculative_config,
                                    vllm_config.structured_outputs_config, self.llm.get_tokenizer())
        except (VLLMClientError, ValueError) as error:
            raise InvalidConstraintError(
                f"invalid {CONSTRAINT_KIND_NAMES[constraint.kind]}: {error}") from error

    def _sampling_params(self, s: SamplingRequest, prompt_len: int) -> SamplingParams:
        assert self.info is not None
        if s.max_tokens is not None and s.max_tokens > self.info.max_model_len:
            raise InvalidRequestError(f"max_tokens is {s.max_tokens}, more than the model's "
                                      f"context of {self.info.max_model_len} tokens")
        # Past the room the prompt leaves, an output would not fit the context: cut to it, as
        # vLLM's server does, since clients send one limit for prompts of every length.
        room = self.info.max_model_len - prompt_len
        # Unset, the model's own limit (generation_config's `max_new_tokens`) applies before the
        # context's, as in vLLM's server.
        max_tokens = s.max_tokens if s.max_tokens is not None else self._defaults.get("max_tokens")
        chosen = {name: value for name, value in (
            ("temperature", s.temperature), ("top_p", s.top_p), ("top_k", s.top_k),
            ("min_p", s.min_p), ("repetition_penalty", s.repetition_penalty)) if value is not None}
        defaults = {k: v for k, v in self._defaults.items()
                    if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        if s.thinking_token_budget is not None and not self.settings.reasoning_parser:
            raise InvalidRequestError(
                "thinking_token_budget needs the engine's reasoning parser, which sees where the "
                "reasoning starts and ends (`backport engine --reasoning-parser`)",
                field="sampling.thinking_token_budget")
        try:
            return SamplingParams(
                **(defaults | chosen), n=s.n, seed=s.seed,
                max_tokens=min(max_tokens, room) if max_tokens is not None else room,
                min_tokens=s.min_tokens, stop_token_ids=list(s.stop_token_ids),
                ignore_eos=s.ignore_eos, logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
                presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                logit_bias=_bounded_logit_bias(s.logit_bias) or None,
                allowed_token_ids=s.allowed_token_ids, bad_words=s.bad_words or None,
                thinking_token_budget=s.thinking_token_budget,
                structured_outputs=s.constraint.params() if s.constraint is not None else None,
                # Detokenization and stop strings belong to the tokenizer service and gateway.
                detokenize=False, output_kind=RequestOutputKind.DELTA)
        except VLLMClientError as error:
            raise InvalidRequestError(str(error)) from error

    def _stat_logger_factory(self, vllm_config: Any, engine_index: int = 0) -> StatLoggerBase:
        return _LoadRecorder(self._scheduler_loads)


def _bounded_logit_bias(logit_bias: dict[int, float]) -> dict[int, float]:
    for token_id, bias in logit_bias.items():
        if math.isnan(bias):
            raise InvalidRequestError(f"logit_bias of token id {token_id} is NaN")
    return {token_id: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias))
            for token_id, bias in logit_bias.items()}


def _choice_update(completion: CompletionOutput, prompt_tokens: int, completion_tokens: int,
                   cached_prompt_tokens: int, num_top_logprobs: int) -> ChoiceUpdate:
    token_ids = list(completion.token_ids)
    logprobs = [_token_logprob(token_id, candidates, num_top_logprobs)
                for token_id, candidates in zip(token_ids, completion.logprobs or [])]
    update = ChoiceUpdate(index=completion.index, token_ids=token_ids, logprobs=logprobs,
                          prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          cached_prompt_tokens=cached_prompt_tokens,
                          finish_reason=completion.finish_reason)
    stopped_by_token = completion.finish_reason == "stop" and not isinstance(completion.stop_reason, str)
    if stopped_by_token and token_ids:
        # The EOS or stop token ends the choice but is not part of its text; it still counts
        # as a completion token and keeps its logprob entry, as in vLLM's own server.
        update.stop_token_id = completion.stop_reason
        update.stopping_token_id = token_ids[-1]
        if len(logprobs) == len(token_ids):
            update.stopping_token_logprob = logprobs[-1]
        update.token_ids, update.logprobs = token_ids[:-1], logprobs[:len(token_ids) - 1]
    return update


def _prompt_logprobs(prompt_token_ids: list[int], scored: list[dict[int, Logprob] | None],
                     num_top: int) -> list[TokenLogprob]:
    """vLLM's prompt logprobs (None for the first token, which nothing precedes) from the
    second token on."""
    return [_token_logprob(token_id, candidates, num_top)
            for token_id, candidates in zip(prompt_token_ids[1:], scored[1:]) if candidates]


def _token_logprob(token_id: int, candidates: dict[int, Logprob], num_top: int) -> TokenLogprob:
    # vLLM's candidates: the token itself, then the top `num_top`, the token among them once.
    # Most likely first; of equal logprobs (bf16 logits tie) the token itself first, as vLLM's
    # server lists them, whatever order its top-k gave the tied ranks.
    ranked = sorted(candidates.items(), key=lambda item: (
        -item[1].logprob, item[0] != token_id, item[1].rank or 0))
    is_among_top = len(candidates) == num_top
    top = [(candidate_id, lp.logprob, lp.rank or 0) for candidate_id, lp in ranked
           if is_among_top or candidate_id != token_id]
    token = candidates[token_id]
    return TokenLogprob(token_id=token_id, logprob=token.logprob, rank=token.rank or 0, top=top)


class _LoadRecorder(StatLoggerBase):
    """Keeps the scheduler's latest counts where `VllmEngine.loads` reads them."""

    def __init__(self, loads: Loads) -> None:
        self._loads = loads

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: Any,
               mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self._loads.num_running = scheduler_stats.num_running_reqs
            self._loads.num_waiting = scheduler_stats.num_waiting_reqs
            self._loads.kv_cache_usage = scheduler_stats.kv_cache_usage

    def log_engine_initialized(self) -> None:
        pass
