"""A process without the deployment's secret that speaks on a PD node's ZMQ rank ports (test-only, loopback).

Run under a pin venv (it needs pyzmq, and Mooncake or NIXL for a destination of its own):
``python -m sglang_harden.testbed.zmq_attacker``; one JSON command a line on stdin, one JSON answer a line on
stdout (the process's own fd 1 goes to stderr: transfer libraries that print cannot garble the answers):

- ``{"op": "send", "to": "tcp://127.0.0.1:PORT", "frames": [hex, ...]}``: one multipart message, unsigned;
- ``{"op": "engine", "bytes": N}``: a Mooncake transfer engine (TCP, loopback) with N registered zero bytes;
  answers its ``session`` id and the buffer's address ``ptr``;
- ``{"op": "nixl", "bytes": N}``: a NIXL agent (UCX, loopback) with N registered zero bytes of host memory
  (device 0); answers its ``name``, its ``metadata`` (hex, what a registration carries) and the buffer's ``ptr``;
- ``{"op": "buffer", "start": A, "end": B}``: how many bytes of that buffer (or of its bytes ``A:B``) are no
  longer zero (KV that reached the attacker);
- ``{"op": "listen"}``: a PULL socket of its own on loopback (where it tells prefill to report the rooms it
  copies); answers its ``port``;
- ``{"op": "inbox"}``: the messages that socket received so far (``messages``: lists of hex frames);
- ``{"op": "quit"}``.

:class:`Attacker` drives it from a test (any python).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

LOOPBACK = "127.0.0.1"


class _Session:
    def __init__(self) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sockets: dict[str, Any] = {}
        self.engine: Any = None
        self.buffer: Any = None
        self.sink: Any = None
        self.sink_port = 0

    def send(self, to: str, frames: list[str]) -> dict[str, Any]:
        if not to.startswith(f"tcp://{LOOPBACK}:"):
            raise ValueError(f"loopback only, not {to}")
        sock = self.sockets.get(to)
        if sock is None:
            sock = self.sockets[to] = self.ctx.socket(self.zmq.PUSH)
            sock.setsockopt(self.zmq.LINGER, 2000)
            sock.setsockopt(self.zmq.SNDTIMEO, 5000)
            sock.connect(to)
        sock.send_multipart([bytes.fromhex(frame) for frame in frames])
        return {"ok": True}

    def make_engine(self, size: int) -> dict[str, Any]:
        import numpy as np
        from mooncake.engine import TransferEngine

        self.buffer = np.zeros(size, dtype=np.uint8)
        self.engine = TransferEngine()
        if self.engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("Mooncake transfer engine did not initialize")
        ptr = int(self.buffer.ctypes.data)
        if self.engine.register_memory(ptr, size) != 0:
            raise RuntimeError("Mooncake memory registration failed")
        return {"session": f"{LOOPBACK}:{self.engine.get_rpc_port()}", "ptr": ptr}

    def make_nixl_agent(self, size: int) -> dict[str, Any]:
        import uuid

        import numpy as np
        from nixl._api import nixl_agent, nixl_agent_config

        self.buffer = np.zeros(size, dtype=np.uint8)
        self.engine = nixl_agent(f"attacker-{uuid.uuid4()}", nixl_agent_config(backends=["UCX"]))
        ptr = int(self.buffer.ctypes.data)
        if not self.engine.register_memory([(ptr, size, 0, "")], "DRAM"):
            raise RuntimeError("NIXL memory registration failed")
        return {"name": self.engine.name, "metadata": bytes(self.engine.get_agent_metadata()).hex(), "ptr": ptr}

    def nonzero(self, start: int = 0, end: int | None = None) -> dict[str, Any]:
        if self.buffer is None:
            return {"nonzero_bytes": 0}
        return {"nonzero_bytes": int((self.buffer[start:end] != 0).sum())}

    def listen(self) -> dict[str, Any]:
        if self.sink is None:
            self.sink = self.ctx.socket(self.zmq.PULL)
            self.sink.setsockopt(self.zmq.LINGER, 0)
            self.sink_port = self.sink.bind_to_random_port(f"tcp://{LOOPBACK}")
        return {"port": self.sink_port}

    def inbox(self) -> dict[str, Any]:
        messages: list[list[str]] = []
        while self.sink is not None and self.sink.poll(0):
            messages.append([frame.hex() for frame in self.sink.recv_multipart()])
        return {"messages": messages}

    def close(self) -> None:
        for sock in [*self.sockets.values(), *([self.sink] if self.sink is not None else [])]:
            sock.close()
        self.ctx.term()


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    session = _Session()
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "quit":
                break
            if command["op"] == "send":
                answer = session.send(command["to"], command["frames"])
            elif command["op"] == "engine":
                answer = session.make_engine(int(command["bytes"]))
            elif command["op"] == "nixl":
                answer = session.make_nixl_agent(int(command["bytes"]))
            elif command["op"] == "buffer":
                answer = session.nonzero(int(command.get("start", 0)), command.get("end"))
            elif command["op"] == "listen":
                answer = session.listen()
            elif command["op"] == "inbox":
                answer = session.inbox()
            else:
                answer = {"error": f"unknown op {command['op']!r}"}
        except Exception as exc:  # noqa: BLE001 - the test reads the error
            answer = {"error": repr(exc)}
        print(json.dumps(answer), file=answers, flush=True)
    session.close()


class Attacker:
    """The attacker process, started with ``python`` (a pin venv's) and stopped by :meth:`close`."""

    def __init__(self, python: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([python, "-m", "sglang_harden.testbed.zmq_attacker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline() or '{"error": "attacker exited"}')
        if "error" in answer:
            raise RuntimeError(f"attacker: {answer['error']}")
        return answer

    def send(self, to: str, frames: list[bytes]) -> None:
        self.ask(op="send", to=to, frames=[frame.hex() for frame in frames])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(op="quit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Attacker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    main()
