"""Generation speed of two checkouts of nano_rlhf, side by side (A B A B ...), each call in a fresh process.

    git worktree add /tmp/before <commit>            # the release to compare against
    python bench/gen_ab.py /tmp/before .             # reference shape: 16 rows, 32-token prompts, 64 new tokens

What bench/bench.py's `gen` row times (the reference shape, float32, 2 threads, T = 1, no end-of-text), on two
source trees: the way to tell a regression of the decode loop from this shared machine's drift, which moves both
sides alike when they alternate.
"""
import argparse
import os
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/bench")
torch.set_num_threads(int(sys.argv[2]))
import bench as B
m = B._model().eval()
ids = torch.randint(2, 4096, (16, 32), generator=torch.Generator().manual_seed(0))
g = torch.Generator().manual_seed(1)
for _ in range(2):
    m.generate(ids, None, 64, temperature=1.0, eos_token_id=None, generator=g)
ts = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); m.generate(ids, None, 64, temperature=1.0, eos_token_id=None, generator=g)
    ts.append(time.perf_counter() - t)
print(sorted(ts)[len(ts) // 2])
"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="first checkout (a directory holding nano_rlhf/ and bench/)")
    p.add_argument("b", help="second checkout")
    p.add_argument("--rounds", type=int, default=3, help="A/B pairs, each a fresh process per side")
    p.add_argument("--calls", type=int, default=8, help="timed calls per process (median kept)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    for d in (a.a, a.b):
        if not os.path.isfile(os.path.join(d, "bench", "bench.py")):
            sys.exit(f"error: {d}: not a nano_rlhf checkout (no bench/bench.py)")
    times = {a.a: [], a.b: []}
    for r in range(a.rounds):
        for d in ((a.a, a.b) if r % 2 == 0 else (a.b, a.a)):
            out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(d), str(a.threads), str(a.calls)],
                                 capture_output=True, text=True, check=True).stdout.split()[-1]
            times[d].append(float(out))
    load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    for d, ts in times.items():
        med = statistics.median(ts)
        print(f"{d}: {med * 1e3:.0f} ms per call ({16 * 64 / med:,.0f} new tok/s), per round {[round(t * 1e3) for t in ts]}")
    print(f"ratio {os.path.basename(os.path.abspath(a.b))} / {os.path.basename(os.path.abspath(a.a))}: "
          f"{statistics.median(times[a.b]) / statistics.median(times[a.a]):.3f} (load average {load})")


if __name__ == "__main__":
    main()
