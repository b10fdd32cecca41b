"""gRPC transport for `VllmEngine`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.engine.exceptions import EngineDeadError

from backport.v1 import common_pb2, engine_pb2_grpc
from backport.v1 import engine_pb2 as pb
from services.engine.kv_events import KvEventCollector, WatchEnded, block_hash_u64
from services.engine.metrics import EngineMetrics
from services.engine.vllm_engine import (ChoiceUpdate, InvalidRequestError,
                                         OutputConstraint, RequestFailedError, SamplingRequest,
                                         TokenLogprob, VllmEngine)

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: VllmEngine, metrics: EngineMetrics,
                 kv_events: KvEventCollector | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.kv_events = kv_events

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        if not self.engine.is_healthy:
            self.metrics.generate_requests.labels("unavailable").inc()
            yield _error(common_pb2.ERROR_CODE_UNAVAILABLE, "the engine is not serving")
            return
        sampling = sampling_request_from_proto(request.sampling)
        updates = self.engine.generate(request.request_id, list(request.prompt_token_ids), sampling,
                                       cache_salt=request.cache_salt or None,
                                       priority=request.priority)
        self.metrics.requests_in_flight.inc()
        settled = False

        def settle(outcome: str) -> None:
            nonlocal settled
            if not settled:
                settled = True
                self.metrics.requests_in_flight.dec()
                self.metrics.generate_requests.labels(outcome).inc()

        num_finished = 0
        try:
            # Closing this generator (the client cancelled) closes `updates`, which aborts in vLLM.
            async for update in updates:
                yield _chunk(update)
                if update.finish_reason is not None:
                    num_finished += 1
                    # The call runs until its last choice finishes (n > 1 choices end apart).
                    # Settled before that choice's last message: a client that has it may
                    # cancel, or read the metrics, at once; after the yield this generator
                    # may not resume before it does.
                    if num_finished == sampling.n:
                        settle("finished")
                    yield _complete(update)
        except InvalidRequestError as error:
            settle("invalid")
            yield _error(common_pb2.ERROR_CODE_INVALID_ARGUMENT, str(error), field=error.field)
        except RequestFailedError as error:
            settle("failed")
            # The engine core has logged the cause with its traceback.
            logger.warning("request %s failed: %s", request.request_id, error)
            yield _error(common_pb2.ERROR_CODE_INTERNAL, str(error))
        except EngineDeadError:
            settle("failed")
            # UNAVAILABLE is what sends the gateway to another engine (INTERNAL ends there).
            yield _error(common_pb2.ERROR_CODE_UNAVAILABLE, "vLLM's engine core is gone")
        except Exception:
            settle("failed")
            logger.exception("request %s failed", request.request_id)
            yield _error(common_pb2.ERROR_CODE_INTERNAL, "internal engine error")
        finally:
            settle("cancelled")
            await updates.aclose()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if request.choice_indexes:
            await self.engine.abort_choices(request.request_id, set(request.choice_indexes))
        else:
            await self.engine.abort(request.request_id)
        return pb.AbortResponse()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        info = self.engine.info
        assert info is not None
        return pb.ModelInfo(served_model_name=info.served_model_name, max_model_len=info.max_model_len,
                            vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
                            tokenizer=info.tokenizer, architecture=info.architecture,
                            default_temperature=info.default_temperature,
                            default_top_p=info.default_top_p)

    async def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> pb.Loads:
        loads = self.engine.loads()
        return pb.Loads(num_running=loads.num_running, num_waiting=loads.num_waiting,
                        kv_cache_usage=loads.kv_cache_usage)


    async def WatchKvEvents(self, request: pb.WatchKvEventsRequest,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventsUpdate]:
        if self.kv_events is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this engine publishes no KV events (start it with "
                                "--kv-events-endpoint)")
        with self.kv_events.watch() as (snapshot, watcher):
            yield pb.KvEventsUpdate(snapshot=pb.KvBlockSnapshot(held=[
                pb.KvHeldBlocks(medium=medium, block_hashes=hashes)
                for medium, hashes in snapshot.items()]))
            while not isinstance(item := await watcher.batches.get(), WatchEnded):
                yield pb.KvEventsUpdate(batch=kv_event_batch_to_proto(item))
        if item is not WatchEnded.ENGINE_STOPPING:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{item.value}; call again")


def kv_event_batch_to_proto(batch: KVEventBatch) -> pb.KvEventBatch:
    events: list[pb.KvEvent] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored = pb.KvBlocksStored(
                block_hashes=[block_hash_u64(h) for h in event.block_hashes],
                token_ids=event.token_ids, block_size=event.block_size, medium=event.medium or "")
            if event.parent_block_hash is not None:
                stored.parent_block_hash = block_hash_u64(event.parent_block_hash)
            events.append(pb.KvEvent(stored=stored))
        elif isinstance(event, BlockRemoved):
            events.append(pb.KvEvent(removed=pb.KvBlocksRemoved(
                block_hashes=[block_hash_u64(h) for h in event.block_hashes],
                medium=event.medium or "")))
        elif isinstance(event, AllBlocksCleared):
            events.append(pb.KvEvent(all_cleared=pb.KvAllBlocksCleared()))
    return pb.KvEventBatch(timestamp=batch.ts, events=events)


def sampling_request_from_proto(p: pb.SamplingParams) -> SamplingRequest:
    def opt(name: str):  # proto3 `optional`: unset is None, never zero
        return getattr(p, name) if p.HasField(name) else None

    return SamplingRequest(
        n=p.n or 1, temperature=opt("temperature"), top_p=opt("top_p"), top_k=opt("top_k"),
        min_p=opt("min_p"), seed=opt("seed"), max_tokens=opt("max_tokens"), min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=opt("logprobs"),
        prompt_logprobs=opt("prompt_logprobs"),
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=opt("repetition_penalty"), logit_bias=dict(p.logit_bias),
        constraint=_constraint_from_proto(p.structured_output),
        # Empty is unset: vLLM refuses an empty list, and the gateway before it.
        allowed_token_ids=list(p.allowed_token_ids) or None, bad_words=list(p.bad_words),
        thinking_token_budget=opt("thinking_token_budget"))


def _constraint_from_proto(p: pb.StructuredOutput) -> OutputConstraint | None:
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return OutputConstraint("choice", list(p.choice.choices), p.after_reasoning)
    return OutputConstraint("json" if kind == "json_schema" else kind, getattr(p, kind),
                            p.after_reasoning)


def _chunk(update: ChoiceUpdate) -> pb.GenerateResponse:
    return pb.GenerateResponse(chunk=pb.GenerateChunk(
        index=update.index, token_ids=update.token_ids,
        logprobs=[_token_logprob(lp) for lp in update.logprobs],
        prompt_tokens=update.prompt_tokens, completion_tokens=update.completion_tokens,
        cached_prompt_tokens=update.cached_prompt_tokens,
        prompt_logprobs=[_token_logprob(lp) for lp in update.prompt_logprobs or []]))


def _token_logprob(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                           top=[pb.TopLogprob(token_id=t, logprob=v, rank=r) for t, v, r in lp.top])


def _complete(update: ChoiceUpdate) -> pb.GenerateResponse:
    complete = pb.GenerateComplete(
        index=update.index, finish_reason=FINISH_REASONS.get(update.finish_reason or "",
                                                             common_pb2.FINISH_REASON_UNSPECIFIED),
        prompt_tokens=update.prompt_tokens, completion_tokens=update.completion_tokens,
        cached_prompt_tokens=update.cached_prompt_tokens)
    if update.stop_token_id is not None:
        complete.stop_token_id = update.stop_token_id
    if update.stopping_token_id is not None:
        complete.stopping_token_id = update.stopping_token_id
    if update.stopping_token_logprob is not None:
        complete.stopping_token_logprob.CopyFrom(_token_logprob(update.stopping_token_logprob))
    return pb.GenerateResponse(complete=complete)


def _error(code: int, message: str, *, field: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(error=pb.GenerateError(code=code, message=message, field=field))
