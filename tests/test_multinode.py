"""Tensor parallelism across machines, on one machine: two process trees that meet on loopback as two
nodes (`minichat serve --tp 2 --nnodes 2 --node-rank 0|1 --dist-init-addr 127.0.0.1:PORT`, gloo).
Greedy output equals transformers; a node that cannot prove the token is turned away; a killed remote
rank is named by node 0 within seconds, and both sides exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.distributed.handshake import HANDSHAKE_LIMIT
from engine.distributed.node import Meeting
from engine.service.client import EngineClient
from tests.test_client_launcher import free_port_pair
from tests.test_tensor_parallel import prompts, wait_ready


def serve(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "engine.service", *args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def dial(port: int, node0: subprocess.Popen[bytes]) -> socket.socket:
    """A raw connection to node 0's control port, once it listens (it opens the port as it starts)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            assert node0.poll() is None and time.monotonic() < deadline, "node 0 never listened"
            time.sleep(0.1)  # polling for the port, bounded by the deadline


def test_config_and_meeting_address_are_checked():
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig.of(tensor_parallel_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="dist_init_addr"):
        EngineConfig.of(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        EngineConfig.of(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="HOST:PORT"):
        Meeting.parse("nohost")
    assert Meeting.parse("127.0.0.1:5000").control == ("127.0.0.1", 5001)
    with pytest.raises(ValueError, match="MINICHAT_TP_TOKEN"):
        Meeting.parse("10.1.2.3:5000").authkey()


def test_two_nodes_on_loopback_match_transformers_and_a_killed_remote_rank_is_named(llama_ckpt, hf, tmp_path):
    port = free_port_pair()
    common = ["--model", str(llama_ckpt), "--device", "cpu", "--tp", "2", "--nnodes", "2",
              "--dist-init-addr", f"127.0.0.1:{port}"]
    address = f"ipc://{tmp_path}/engine.sock"
    node0_log, node1_log, intruder_log = tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "intruder.log"
    node0 = serve("--address", address, *common, "--node-rank", "0", log=node0_log)
    # a peer that connects and says nothing, one that sends garbage, and a node with the wrong token are turned
    # away (the silent one after the handshake's limit), and the real node still joins
    silent = dial(port + 1, node0)
    garbage = dial(port + 1, node0)
    garbage.sendall(b"\x00\x00\x00\x08not hmac" * 64)
    intruder = serve(*common, "--node-rank", "1", log=intruder_log, env={**os.environ, "MINICHAT_TP_TOKEN": "wrong"})
    node1 = None
    try:
        assert intruder.wait(120) != 0, intruder_log.read_text()
        node1 = serve(*common, "--node-rank", "1", log=node1_log)
        wait_ready(address, node0, node0_log, 180)
        silent.settimeout(HANDSHAKE_LIMIT + 30)
        while silent.recv(1 << 16):  # node 0's challenge, then the end once the limit cut it off
            pass
        cut = f"did not complete the handshake within {HANDSHAKE_LIMIT:g} s"
        deadline = time.monotonic() + 30  # node 0 logs the cut a moment after it shut the socket
        while cut not in (log := node0_log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cut in log and log.count("dropped a connection from 127.0.0.1") >= 3, log  # silent, garbage, intruder
        with EngineClient(address) as client:
            assert client.info().config["nnodes"] == 2
            for prompt in prompts(3, seed=21, max_len=30):
                out = client.complete(prompt, max_tokens=6, ignore_eos=True)
                hf.check_greedy(out.token_ids, llama_ckpt, prompt, 6)
            stats = client.stats()
            assert not stats.running and stats.pages.held == stats.pages.locked == 0
        worker = int(subprocess.check_output(["pgrep", "-P", str(node1.pid)]).split()[0])
        os.kill(worker, signal.SIGKILL)
        assert node0.wait(20) == 1, node0_log.read_text()
        assert "tensor-parallel rank 1 (on another node)" in node0_log.read_text()
        assert node1.wait(20) != 0, node1_log.read_text()
    finally:
        silent.close()
        garbage.close()
        stop(node0, intruder, *([node1] if node1 is not None else []))
