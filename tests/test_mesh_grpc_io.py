"""Every service of the mesh does its gRPC socket I/O on grpc's polling threads
(`services/mesh/grpc_io.py`): streamed chats through a real `backport up` mesh wake grpc's
`event_engine` threads in the gateway and the tokenizer service no more than the same time
idle does (their timers run there either way), give or take a per-call cost spread over the
chunks. With grpcio's default I/O each streamed chunk woke them 4-7 more times."""

from __future__ import annotations

import time

import openai

from tests.cluster.processes import child_pid
from tests.conftest import RunningMesh
from tests.ple.service_process import thread_status

MODEL = "SmolLM2-135M-Instruct-bf16"
NUM_CHATS = 4
# Each call also wakes them a few times whatever its length (deadline timers, stream set-up):
# 32 chunks a chat spread that cost to 0.0-0.4 wake-ups a chunk here, against 3.6-6.7 with
# grpcio's default I/O. 16-chunk chats measured up to 1.2 on a loaded CI machine.
TOKENS_PER_CHAT = 32
MAX_WAKEUPS_PER_CHUNK = 2
# The calls of a chat's stream pass through these two; the engine sends its chunks in a few
# writes, so its wake-ups differ too little from its timers' to tell the I/O apart.
SERVICES = ("gateway", "tokenizer")


def _event_engine_wakeups(pids: dict[str, int]) -> dict[str, int]:
    return {service: sum(int(switches) for name, switches in
                         thread_status(pid, "voluntary_ctxt_switches") if name == "event_engine")
            for service, pid in pids.items()}


def test_streamed_chats_wake_no_more_event_engine_threads_than_idle_time(mesh: RunningMesh) -> None:
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)

    def chat() -> int:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to twenty."}],
            max_tokens=TOKENS_PER_CHAT, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        return sum(1 for _ in stream)

    chat()  # channels and streams open before counting
    pids = {service: child_pid(mesh.process.pid, "services.cli", service) for service in SERVICES}
    before = _event_engine_wakeups(pids)
    started = time.monotonic()
    num_chunks = sum(chat() for _ in range(NUM_CHATS))
    busy_s = time.monotonic() - started
    during_chats = _event_engine_wakeups(pids)
    time.sleep(busy_s)
    after_idle = _event_engine_wakeups(pids)
    per_chunk = {service: ((during_chats[service] - before[service])
                           - (after_idle[service] - during_chats[service])) / num_chunks
                 for service in SERVICES}
    assert num_chunks >= NUM_CHATS * TOKENS_PER_CHAT
    assert all(wakeups < MAX_WAKEUPS_PER_CHUNK for wakeups in per_chunk.values()), per_chunk
