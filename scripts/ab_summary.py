#!/usr/bin/env python3
"""Summarise scripts/gpu_ab.sh's ab.log: per (shape, M, path) the median full-layer time of the
base and the new tree over the rounds, their ratio, and the geometric mean of the ratios (a
(shape, M) whose two sides ran one different path each pairs as "basepath>newpath").

    scripts/ab_summary.py gpu_out/ab.log
"""
import collections
import re
import statistics
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    times = collections.defaultdict(list)
    cur = None
    with open(sys.argv[1]) as f:
        for line in f:
            m = re.match(r"== (base|new) round", line)
            if m:
                cur = m.group(1)
                continue
            p = line.split()
            if cur and len(p) >= 4 and p[1].isdigit():
                times[(p[0], int(p[1]), p[2], cur)].append(float(p[3]))
    # (shape, M) whose base and new rows name one path each but not the same one (e.g. auto's
    # single path against the batch-invariant mode's grouped path) pair as "base>new"
    paths = collections.defaultdict(lambda: {"base": set(), "new": set()})
    for k in times:
        paths[k[:2]][k[3]].add(k[2])
    for sm, pv in paths.items():
        if len(pv["base"]) == 1 and len(pv["new"]) == 1 and pv["base"] != pv["new"]:
            pb, pn = next(iter(pv["base"])), next(iter(pv["new"]))
            times[sm + (pb + ">" + pn, "base")] = times.pop(sm + (pb, "base"))
            times[sm + (pb + ">" + pn, "new")] = times.pop(sm + (pn, "new"))
    keys = sorted({k[:3] for k in times})
    ratios = []
    print(f"{'shape':22s} {'M':>5s} {'path':15s} {'base us':>9s} {'new us':>9s} {'new/base':>9s}")
    for k in keys:
        b, n = times.get(k + ("base",)), times.get(k + ("new",))
        if not b or not n:
            continue
        r = statistics.median(n) / statistics.median(b)
        ratios.append(r)
        print(f"{k[0]:22s} {k[1]:5d} {k[2]:15s} {statistics.median(b):9.1f} "
              f"{statistics.median(n):9.1f} {r:9.3f}")
    if ratios:
        print(f"geometric mean new/base over {len(ratios)} points: "
              f"{statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
