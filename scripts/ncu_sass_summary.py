#!/usr/bin/env python3
"""Summarise an Nsight Compute `--page source --print-source sass --csv` export of one kernel.

Prints the sample total, the hottest instructions with their two main stall reasons, and the
samples per block of consecutive instructions (with the wgmma / mma / mbarrier / block-barrier
instructions each block holds, which tell the kernel's regions apart).

    scripts/ncu_sass_summary.py gpu_out/ncu_sass.csv.gz [--top 30] [--block 250]
"""
import argparse
import csv
import gzip
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header, data = None, []
    for r in rows:
        if r and r[0] == "Address":
            header = r
            continue
        if header and len(r) == len(header) and r[0].startswith("0x"):
            data.append(r)
    if header is None or not data:
        sys.exit(f"{path}: no SASS rows (expected an ncu --page source --csv export)")
    return header, data


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--block", type=int, default=250)
    a = ap.parse_args()
    header, data = load(a.csv)
    col = {h: i for i, h in enumerate(header)}
    samples_col = col.get("Warp Stall Sampling (All Samples)")
    if samples_col is None:
        sys.exit("no 'Warp Stall Sampling (All Samples)' column")
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def samples(r):
        v = r[samples_col].replace(",", "")
        return int(v) if v.isdigit() else 0

    def stalls(rows):
        acc = {}
        for r in rows:
            for h in stall_cols:
                v = r[col[h]].replace(",", "")
                if v.isdigit():
                    acc[h] = acc.get(h, 0) + int(v)
        return sorted(acc.items(), key=lambda kv: -kv[1])

    total = sum(samples(r) for r in data) or 1
    print(f"{len(data)} instructions, {total} stall samples")
    print("\nhottest instructions (index, samples, executions, instruction, main stalls):")
    hot = sorted(range(len(data)), key=lambda i: -samples(data[i]))[: a.top]
    for i in sorted(hot):
        r = data[i]
        top = ", ".join(f"{k[6:]} {v}" for k, v in stalls([r])[:2] if v)
        execs = r[col["Instructions Executed"]] if "Instructions Executed" in col else "?"
        print(f"{i:6d} {samples(r):6d} {execs:>8} {r[1].strip()[:58]:58s} {top}")
    print(f"\nsamples per block of {a.block} instructions:")
    for b0 in range(0, len(data), a.block):
        blk = data[b0 : b0 + a.block]
        s = sum(samples(r) for r in blk)
        if s == 0:
            continue
        kinds = {
            "gmma": sum("GMMA" in r[1] for r in blk),
            "hmma": sum("HMMA" in r[1] for r in blk),
            "mbar": sum("SYNCS" in r[1] for r in blk),
            "bar": sum("BAR." in r[1] for r in blk),
        }
        k = " ".join(f"{n}={v}" for n, v in kinds.items() if v)
        top = ", ".join(f"{n[6:]} {v}" for n, v in stalls(blk)[:3] if v)
        print(f"{b0:6d}-{b0 + len(blk):6d} {s:6d} ({100.0 * s / total:4.1f}%) {k:28s} {top}")


if __name__ == "__main__":
    main()
