"""A link's send side: messages leave in order, and posting never blocks the compute thread."""

from __future__ import annotations

import socket
import threading
import time

import torch

from rrfp_ray.runtime.links import LinkSender
from rrfp_ray.runtime.streams import Handoff
from rrfp_ray.runtime.tcp_channel import TcpChannel
from rrfp_ray.runtime.transport import Header, MessageReader
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Link, Message

ELEMS = 4096  # 16 KB a message: the posting thread writes it itself
MESSAGES = 300  # 4.8 MB each way: far past what two socket buffers hold


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        dialed = socket.create_connection(server.getsockname()[:2])
        accepted, _ = server.accept()
    return dialed, accepted


def _header(kind: Kind, mb: int, payload: torch.Tensor) -> Header:
    return Header.for_payload(message=Message(kind=kind, virtual_stage=0, microbatch=mb), iteration=0, payload=payload)


def test_two_stages_sending_to_each_other_never_block_and_every_message_arrives_in_order() -> None:
    a, b = _tcp_pair()
    ends = {name: TcpChannel(name=name, sock=sock, timeout_s=20) for name, sock in (("a->b", a), ("b->a", b))}
    errors: list[BaseException] = []
    senders = [
        LinkSender(
            link=Link(src=src, dst=1 - src, kind=kind), channel=ends[name], handoff=Handoff(), on_error=errors.append
        )
        for src, kind, name in ((0, Kind.F, "a->b"), (1, Kind.B, "b->a"))
    ]
    slowest = 0.0
    for mb in range(MESSAGES):  # neither side reads meanwhile
        for sender, kind in zip(senders, (Kind.F, Kind.B)):
            payload = torch.full((ELEMS,), float(mb))
            began = time.perf_counter()
            sender.post(header=_header(kind, mb, payload), payload=payload, release=began)
            slowest = max(slowest, time.perf_counter() - began)
    assert slowest < 1.0  # a blocked post would wait for a reader that never comes until all posts are done
    received: dict[str, list[float]] = {}

    def read(name: str) -> None:
        reader = MessageReader(channel=ends[name])
        received[name] = [float(reader.recv()[1][0]) for _ in range(MESSAGES)]

    readers = [threading.Thread(target=read, args=(name,)) for name in ends]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join(timeout=30)
    assert not errors
    assert received == {name: [float(mb) for mb in range(MESSAGES)] for name in ends}
    for sender in senders:
        assert sender.wait_idle(timeout_s=5)
    for channel in ends.values():
        channel.close()
    for sender in senders:
        sender.close(timeout_s=2)
