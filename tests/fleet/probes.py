"""Small programs run inside a fleet's hosts: UDP echo, one datagram out and back, and a count
of datagrams that arrive (what the switch let through)."""

from __future__ import annotations

import subprocess
import sys

from kvsp_moq.netns import Host

#: a UDP echo server on port 9999: one datagram back for each received
ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
print("listening", flush=True)
while True:
    data, peer = s.recvfrom(65536)
    s.sendto(data, peer)
"""

#: one datagram to the echo server and its answer: "ok", "timeout" or "too big"
SEND = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO: never fragment
s.settimeout(1)
try:
    s.sendto(b"x" * int(sys.argv[2]), (sys.argv[1], 9999))
    print("ok" if len(s.recv(65536)) == int(sys.argv[2]) else "short")
except OSError as e:
    print("timeout" if isinstance(e, TimeoutError) else "too big")
"""

#: counts datagrams on port 9998 until an "end" datagram, or 3 s without any
COUNT = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE: none dropped for want of room
s.bind((sys.argv[1], 9998))
s.settimeout(3)
print("listening", flush=True)
n = 0
try:
    while True:
        if s.recv(2048) == b"end":
            break
        n += 1
except TimeoutError:
    pass
print(n, flush=True)
"""

#: sends argv[2] datagrams to port 9998, then "end" 50 times
BLAST = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    s.sendto(b"d" * 64, (sys.argv[1], 9998))
for _ in range(50):
    s.sendto(b"end", (sys.argv[1], 9998))
"""


def echo_server(host: Host) -> None:
    server = host.start([sys.executable, "-c", ECHO, host.address], stdout=subprocess.PIPE)
    assert server.stdout is not None and server.stdout.readline() == b"listening\n"


def send(host: Host, address: str, size: int = 100) -> str:
    out = host.run([sys.executable, "-c", SEND, address, str(size)], capture_output=True, text=True)
    return out.stdout.strip() or out.stderr


def reaches(host: Host, address: str, tries: int = 5) -> bool:
    """Whether an echo comes back within a few tries (after a partition, address resolution
    retries once a second, so the first datagram may wait longer than one try)."""
    return any(send(host, address) == "ok" for _ in range(tries))


def delivered(sender: Host, receiver: Host, count: int) -> int:
    """How many of `count` datagrams from sender reach receiver."""
    counter = receiver.start([sys.executable, "-c", COUNT, receiver.address], stdout=subprocess.PIPE, text=True)
    assert counter.stdout is not None and counter.stdout.readline() == "listening\n"
    sender.run([sys.executable, "-c", BLAST, receiver.address, str(count)], check=True)
    return int(counter.stdout.readline())

#: a TCP sink on port 9997: prints how many octets one connection brought
SINK = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 9997))
s.listen()
print("listening", flush=True)
c, _ = s.accept()
n = 0
while data := c.recv(1 << 20):
    n += len(data)
print(n, flush=True)
"""

#: sends argv[2] octets to the TCP sink
SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], 9997))
s.sendall(b"t" * int(sys.argv[2]))
s.close()
"""


def streamed(sender: Host, receiver: Host, octets: int) -> int:
    """Octets of one TCP connection from sender that reach receiver."""
    sink = receiver.start([sys.executable, "-c", SINK, receiver.address], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None and sink.stdout.readline() == "listening\n"
    sender.run([sys.executable, "-c", SOURCE, receiver.address, str(octets)], check=True)
    return int(sink.stdout.readline())
