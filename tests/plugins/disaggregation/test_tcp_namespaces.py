"""The TCP connector between two hosts: two network namespaces made here, joined by a veth pair
(10.231.0.1 and 10.231.0.2), a prefill-side process serving a staged KV in one, a decode-side
process fetching it from the other. Skipped where namespaces cannot be made (not root, no `ip`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2's `ip`")

SERVER = textwrap.dedent("""
    import json, sys, time, torch
    from loopstack.plugins.disaggregation.tcp import TcpConnector
    connector = TcpConnector(host="10.231.0.1", chunk_blocks=5)
    kv = torch.arange(2 * 2 * 40 * 4 * 2 * 8, dtype=torch.float32).view(2, 2, 40, 4, 2, 8)
    ticket = connector.offer("lease-1", kv, lease_s=60)
    open(sys.argv[1], "w").write(json.dumps(ticket.__dict__))
    while not __import__("os").path.exists(sys.argv[2]):
        time.sleep(0.05)
    print(json.dumps(connector.stats.as_dict()))
    connector.close()
""")
CLIENT = textwrap.dedent("""
    import json, sys, torch
    from loopstack.engine.seams.kv_connector import TransferTicket
    from loopstack.plugins.disaggregation.tcp import TcpConnector
    fields = json.load(open(sys.argv[1]))
    ticket = TransferTicket(**{**fields, "shape": tuple(fields["shape"])})
    out = torch.zeros(ticket.shape)
    def write(first, chunk):
        out[:, :, first:first + chunk.shape[2]] = chunk
    stats = TcpConnector().fetch(ticket, range(ticket.num_blocks), write, timeout=20)
    expected = torch.arange(out.numel(), dtype=torch.float32).view(out.shape)
    print(json.dumps({"equal": bool(torch.equal(out, expected)), "chunks": stats.num_chunks,
                      "bytes": stats.nbytes}))
""")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def namespaces():
    tag = uuid.uuid4().hex[:6]
    a, b = f"lsk-a-{tag}", f"lsk-b-{tag}"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        sh("ip", "link", "set", f"va{tag}", "netns", a)
        sh("ip", "link", "set", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", "10.231.0.1/24"), (b, f"vb{tag}", "10.231.0.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {exc}")
    yield a, b
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_kv_crosses_between_two_network_namespaces(namespaces, tmp_path):
    a, b = namespaces
    ticket_file, done_file = tmp_path / "ticket.json", tmp_path / "done"
    server = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-c", SERVER, str(ticket_file),
                               str(done_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ticket_file.exists() or not ticket_file.read_text():
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "the server never staged its KV"
            time.sleep(0.05)
        assert json.loads(ticket_file.read_text())["address"].startswith("tcp://10.231.0.1:")
        client = subprocess.run(["ip", "netns", "exec", b, sys.executable, "-c", CLIENT, str(ticket_file)],
                                capture_output=True, text=True, timeout=60)
        assert client.returncode == 0, client.stderr
        result = json.loads(client.stdout)
        assert result == {"equal": True, "chunks": 8, "bytes": 2 * 2 * 40 * 4 * 2 * 8 * 4}
    finally:
        done_file.write_text("")
        out, err = server.communicate(timeout=30)
    assert server.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["num_offered"] == 1
