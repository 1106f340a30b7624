"""What TLS costs: one broker with a plain and a TLS native listener side by side, loaded
through each in turn by ``blipmq bench`` (forked publisher and subscriber processes).

    .venv/bin/python bench/tls.py                       # 3 rounds of each, about 2 min
    .venv/bin/python bench/tls.py --rounds 5 -n 300000
    .venv/bin/python bench/tls.py --source /tmp/other --plain-only
                            # another tree's broker (PYTHONPATH), one without TLS even

Each round runs, through the plain port and then the TLS port: a flat-out 1 -> 1 run of
``-n`` 100-byte QoS 0 messages (throughput; the broker's CPU per delivery from /proc), and a
paced one at ``--rate`` messages/s (latency percentiles). Certificates come from trustme
(a dev dependency). It prints one JSON object: every run, and the median of each figure.
Benchmarks never gate anything; the machine's noise is in the spread of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import free_port, wait_port

TOP = Path(__file__).resolve().parent.parent
BLIPMQ = [sys.executable, "-m", "blipmq_cli.main"]
TICKS = os.sysconf("SC_CLK_TCK")


def broker_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def bench(addr: str, env: dict[str, str], *args: str) -> dict:
    done = subprocess.run([*BLIPMQ, "bench", "--json", "--addr", addr, *args], env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-n", "--messages", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--paced", type=int, default=20_000, help="messages of a paced run")
    parser.add_argument("--source", default=str(TOP), help="the tree whose broker runs")
    parser.add_argument("--plain-only", action="store_true", help="no TLS listener")
    opts = parser.parse_args()
    import trustme

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(work / "ca.pem"))
        cert = ca.issue_cert("127.0.0.1")
        cert.private_key_and_cert_chain_pem.write_to_path(str(work / "broker.pem"))
        plain, tls, metrics = free_port(), free_port(), free_port()
        config = f"[server]\nport = {plain}\n"
        if not opts.plain_only:
            pem = work / "broker.pem"
            config += f"tls = true\ntls_port = {tls}\n[tls]\ncert_file = \"{pem}\"\n"
        config += f"[metrics]\nport = {metrics}\n[wal]\nenabled = false\n"
        (work / "blipmq.toml").write_text(config)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
        broker_env = {**env, "PYTHONPATH": opts.source}
        broker = subprocess.Popen(
            [*BLIPMQ, "start", "--config", str(work / "blipmq.toml"), "--data-dir",
             str(work / "data"), "--log-level", "warning"], env=broker_env, cwd=opts.source)
        try:
            assert wait_port(plain, broker), "no broker"
            assert opts.plain_only or wait_port(tls, broker), "no TLS listener"
            client_env = {**env, "BLIPMQ_CAFILE": str(work / "ca.pem")}
            addrs = {"plain": f"tcp://127.0.0.1:{plain}", "tls": f"tls://127.0.0.1:{tls}"}
            if opts.plain_only:
                del addrs["tls"]
            runs: dict[str, list[dict]] = {name: [] for name in addrs}
            for _ in range(opts.rounds):
                for name, addr in addrs.items():
                    cpu = broker_cpu(broker.pid)
                    flat = bench(addr, client_env, "-n", str(opts.messages), "-s", "1")
                    cpu = broker_cpu(broker.pid) - cpu
                    paced = bench(addr, client_env, "-n", str(opts.paced), "-s", "1",
                                  "--rate", str(opts.rate))
                    runs[name].append({
                        "msg_per_s": flat["msg_per_s"], "lost": flat["lost"] + paced["lost"],
                        "broker_cpu_us_per_delivery": round(cpu / flat["delivered"] * 1e6, 2),
                        "p50_us": paced["latency_us"]["p50"],
                        "p99_us": paced["latency_us"]["p99"]})
            median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                      for name, rs in runs.items()}
        finally:
            broker.terminate()
            broker.wait(30)
    print(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "source": opts.source,
                      "messages": opts.messages, "rate": opts.rate, "median": median,
                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
