"""Every INTERVAL s, one JSON line: the CPU seconds (user + system) each thread of every
SGLang / Python process has used so far, with the core it last ran on, and the machine's
per-core steal and busy jiffies (/proc/stat). Run beside a serving benchmark; kill to stop.

  python3 threads.py OUT.jsonl [INTERVAL]
"""

import json
import os
import sys
import time

out, interval = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
tick = os.sysconf("SC_CLK_TCK")


def procs() -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"sglang" in cmd or b"bench_e2e" in cmd:
                pids.append(int(p))
    return pids


with open(out, "a") as sink:
    while True:
        row = {"t": time.time(), "threads": [], "cpus": {}}
        for pid in procs():
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        s = f.read()
                    comm = s[s.index("(") + 1:s.rindex(")")]
                    rest = s[s.rindex(")") + 2:].split()
                    cpu_s = (int(rest[11]) + int(rest[12])) / tick
                    row["threads"].append([pid, int(tid), comm, round(cpu_s, 2), int(rest[36])])
            except (OSError, ValueError, IndexError):
                continue
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu"):
                    v = line.split()
                    busy = sum(int(x) for x in v[1:4]) + int(v[6]) + int(v[7])
                    row["cpus"][v[0]] = [busy, int(v[8])]  # busy, steal (jiffies)
        sink.write(json.dumps(row) + "\n")
        sink.flush()
        time.sleep(interval)
