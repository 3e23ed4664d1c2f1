"""What one message costs in the framing itself (`rrfp_ray.runtime.transport`), host frames against
frames built with torch ops (`rrfp_ray.runtime.frames`; `DeviceFrames` on the CPU is the torch-op
path), what `jobs/bench_framing.py` prints:

- `in_thread`: a message framed and read back over an in-memory channel on one thread, alone and
  beside one busy Python thread (a stage's compute thread between two ops, or another link's
  thread, holds the GIL the same way);
- `ping_pong`: half a round trip between two processes over a TCP link, as a stage's send and
  receive threads make it (no Ray);
- `after_sleep`: the thread CPU time to frame, write and read back one message over a TCP link on
  one thread, each message after a 2 ms sleep, as a stage's compute thread sends and reads between
  ops that leave the core idle (code and data are then colder than in a loop of messages).
"""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rrfp_ray.runtime.frames import DeviceFrames, Frames, HostFrames
from rrfp_ray.runtime.tcp_channel import TcpChannel
from rrfp_ray.runtime.transport import Header, LocalChannel, MessageReader, MessageWriter
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Message

FRAMES: dict[str, Frames] = {"host": HostFrames(), "torch ops": DeviceFrames(device="cpu")}
_MESSAGE = Message(kind=Kind.F, virtual_stage=1, microbatch=0)
_TIMEOUT_S = 30.0


def in_thread(*, frames: str, payload_elems: int, busy: bool, messages: int) -> float:
    """Microseconds per message framed, sent and read back on one thread."""
    channel = LocalChannel(name="bench", timeout_s=_TIMEOUT_S)
    writer = MessageWriter(channel=channel, frames=FRAMES[frames])
    reader = MessageReader(channel=channel, frames=FRAMES[frames])
    payload = torch.randn(payload_elems)

    def one() -> None:
        writer.send(header=Header.for_payload(message=_MESSAGE, iteration=0, payload=payload), payload=payload)
        reader.recv()

    for _ in range(20):
        one()
    with _busy_thread(on=busy):
        began = time.perf_counter()
        for _ in range(messages):
            one()
        return (time.perf_counter() - began) / messages * 1e6


def ping_pong(*, frames: str, payload_elems: int, messages: int) -> float:
    """Microseconds per one-way message between two processes over TCP (half the round trip)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        context = multiprocessing.get_context("spawn")
        echo = context.Process(
            target=_echo, kwargs={"port": server.getsockname()[1], "frames": frames, "messages": messages + 20}
        )
        echo.start()
        server.settimeout(_TIMEOUT_S)
        sock, _ = server.accept()
    channel = TcpChannel(name="bench", sock=sock, timeout_s=_TIMEOUT_S)
    writer = MessageWriter(channel=channel, frames=FRAMES[frames])
    reader = MessageReader(channel=channel, frames=FRAMES[frames])
    payload = torch.randn(payload_elems)
    try:
        for index in range(messages + 20):
            if index == 20:
                began = time.perf_counter()
            writer.send(header=Header.for_payload(message=_MESSAGE, iteration=0, payload=payload), payload=payload)
            reader.recv()
        return (time.perf_counter() - began) / messages / 2 * 1e6
    finally:
        channel.close()
        echo.join(timeout=_TIMEOUT_S)


def after_sleep(*, frames: str, payload_elems: int, messages: int, sleep_s: float = 0.002) -> float:
    """CPU microseconds (thread clock) per message framed, written and read back over TCP on one thread,
    each after `sleep_s` of sleep."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        server.settimeout(_TIMEOUT_S)
        accepted, _ = server.accept()
    sending = TcpChannel(name="bench out", sock=client, timeout_s=_TIMEOUT_S)
    receiving = TcpChannel(name="bench in", sock=accepted, timeout_s=_TIMEOUT_S)
    writer = MessageWriter(channel=sending, frames=FRAMES[frames])
    reader = MessageReader(channel=receiving, frames=FRAMES[frames])
    payload = torch.randn(payload_elems)
    spent = 0.0
    try:
        for index in range(messages + 20):
            time.sleep(sleep_s)
            began = time.thread_time()
            writer.send(header=Header.for_payload(message=_MESSAGE, iteration=0, payload=payload), payload=payload)
            reader.recv()
            if index >= 20:
                spent += time.thread_time() - began
        return spent / messages * 1e6
    finally:
        sending.close()
        receiving.close()


def _echo(*, port: int, frames: str, messages: int) -> None:
    torch.set_num_threads(1)
    channel = TcpChannel(name="echo", sock=socket.create_connection(("127.0.0.1", port)), timeout_s=_TIMEOUT_S)
    writer = MessageWriter(channel=channel, frames=FRAMES[frames])
    reader = MessageReader(channel=channel, frames=FRAMES[frames])
    for _ in range(messages):
        header, payload = reader.recv()
        writer.send(header=header, payload=payload)
    channel.close()


@contextmanager
def _busy_thread(*, on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, name="busy", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
