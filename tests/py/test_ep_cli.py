#!/usr/bin/env python3
"""fp8moe run/bench --ep on the CPU: simulated EP ranks against the single-rank layer.

On the example checkpoint (`fp8moe make-example`, 8 experts, top-2), `run --ep N` for N = 1..8
must give the same output as the plain single-rank `run` (a separate process: same seed, same
input), bit for bit: with top-2 a token's two slot outputs are either summed on one rank exactly as
on a single rank, or come back as two bf16 partials that the combine adds in f32 and rounds once,
which is what the single-rank kernel does. With top-4 (three or more partials summed in another
order) the EP output must stay within vLLM's tolerance. Also: zero-token ranks, uneven expert
counts, the batched format (the reference kernel), bench --ep, and bad values (exit status 2 with
a clear message).
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def run(args, env=None):
    # The simulated ranks are the CPU path: keep any GPU of the machine out of it.
    e = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    if env:
        e.update(env)
    return subprocess.run([BIN] + args, capture_output=True, text=True, env=e, timeout=300)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    kinds = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + b:8 + n + e], dtype=kinds[t["dtype"]]).reshape(
            t["shape"])
    return out


def bits(a):
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a.view(np.uint32)


def run_json(args, what):
    p = run(args + ["--json"])
    check(p.returncode == 0, f"{what}: exit {p.returncode}: {p.stderr.strip()[-400:]}")
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        check(False, f"{what}: no JSON: {p.stdout[-300:]}")
        return {}


def expect_error(args, needle, what, env=None):
    p = run(args, env)
    check(p.returncode == 2, f"{what}: exit {p.returncode}, expected 2 ({p.stderr.strip()})")
    check(needle in p.stderr, f"{what}: '{needle}' not in: {p.stderr.strip()}")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        ex = os.path.join(tmp, "ex")
        p = run(["make-example", ex])
        check(p.returncode == 0, f"make-example: {p.stderr}")

        # The single-rank layer (the oracle's CPU kernel), then EP 1..8 from separate processes.
        for tokens in (32, 1):
            single = os.path.join(tmp, f"single{tokens}.safetensors")
            p = run(["run", ex, "--tokens", str(tokens), "--reps", "1", "--output", single])
            check(p.returncode == 0, f"single-rank run: {p.stderr}")
            want = read_safetensors(single)
            for ep in ((1, 2, 3, 4, 8) if tokens == 32 else (4,)):
                path = os.path.join(tmp, f"ep{ep}_{tokens}.safetensors")
                j = run_json(["run", ex, "--ep", str(ep), "--tokens", str(tokens), "--reps", "2",
                              "--check", "--output", path], f"run --ep {ep} tokens {tokens}")
                if not j:
                    continue
                got = read_safetensors(path)
                check(np.array_equal(bits(got["x"]), bits(want["x"])), f"ep {ep}: same input")
                diff = int(np.count_nonzero(bits(got["out"]) != bits(want["out"])))
                check(diff == 0, f"ep {ep} tokens {tokens}: {diff} of {got['out'].size} output "
                      "values differ in bits from the single-rank run")
                e = j["ep"]
                check(j["ok"] and j["check"]["pass"], f"ep {ep}: --check passes")
                check(j["check"]["vs_single_rank"]["bitwise_equal"],
                      f"ep {ep}: --check reports bitwise equality with one rank")
                check(e["size"] == ep and e["communicator"] == "inprocess", f"ep {ep}: group")
                check(e["format"] == "standard", f"ep {ep}: the oracle's format is standard")
                ranks = e["ranks"]
                check([r["tokens"] for r in ranks] ==
                      [tokens // ep + (1 if r < tokens % ep else 0) for r in range(ep)],
                      f"ep {ep}: balanced contiguous token split {[r['tokens'] for r in ranks]}")
                experts = [x for r in ranks for x in r["experts"]]
                check(experts == list(range(8)), f"ep {ep}: every expert once, in order")
                sizes = [len(r["experts"]) for r in ranks]
                check(sizes == [8 // ep + (1 if r < 8 % ep else 0) for r in range(ep)],
                      f"ep {ep}: vLLM's linear placement {sizes}")
                check(sum(r["rows_sent"] for r in ranks) == sum(r["rows_received"] for r in ranks),
                      f"ep {ep}: rows sent = rows received")
                check(all(r["rows_sent"] <= 2 * r["tokens"] for r in ranks),
                      f"ep {ep}: a token goes at most once to each of its top-2 experts' ranks")
                check(0 <= e["communication_fraction"] <= 1 and e["layer_median_s"] > 0,
                      f"ep {ep}: timings")

        # Zero tokens on every rank.
        j = run_json(["run", ex, "--ep", "2", "--tokens", "0", "--reps", "1", "--check"],
                     "run --ep 2 --tokens 0")
        check(j.get("ok") is True, "zero tokens: ok")

        # Top-4: partials of three or four ranks are summed in another order than on one rank.
        ex4 = os.path.join(tmp, "ex4")
        p = run(["make-example", ex4, "--topk", "4", "--experts", "6", "--layers", "1"])
        check(p.returncode == 0, f"make-example --topk 4: {p.stderr}")
        j = run_json(["run", ex4, "--ep", "3", "--tokens", "24", "--reps", "1", "--check"],
                     "top-4 --ep 3")
        if j:
            c = j["check"]["vs_single_rank"]
            check(j["ok"] and c["allclose"], f"top-4 ep 3: within tolerance ({c})")
            check(c["mean_rel_abs_err"] < 0.01, f"top-4 ep 3: mean relative error {c}")

        # The batched (masked) format through the reference kernel (f32 partials).
        j = run_json(["run", ex, "--ep", "3", "--tokens", "5", "--reps", "1", "--kernel", "ref",
                      "--ep-format", "batched", "--check"], "batched --ep 3 (ref)")
        if j:
            check(j["ep"]["format"] == "batched", "batched format reported")
            check(j["ok"] and j["check"]["vs_reference"]["allclose"], "batched: within tolerance")
        # The standard format with the reference: f32 partials, one rounding after the combine.
        j = run_json(["run", ex, "--ep", "4", "--tokens", "6", "--reps", "1", "--kernel", "ref",
                      "--check"], "standard --ep 4 (ref)")
        if j:
            check(j["check"]["vs_single_rank"]["bitwise_equal"], "ref ep 4: bitwise equal")

        # Text output names the ranks and the split.
        p = run(["run", ex, "--ep", "2", "--tokens", "4", "--reps", "1", "--check", "--brief"])
        check(p.returncode == 0 and "result  PASS" in p.stdout and "rank 1" in p.stdout
              and "dispatch + combine" in p.stdout, f"text output: {p.stdout[-600:]}")

        # Bad values: exit status 2, one clear line.
        expect_error(["run", ex, "--ep", "0"], "--ep 0 must be >= 1", "--ep 0")
        expect_error(["run", ex, "--ep", "-2"], "must be >= 1", "--ep -2")
        expect_error(["run", ex, "--ep", "9"], "8 routed experts", "--ep 9 > experts")
        expect_error(["run", ex, "--ep", "2", "--tp", "2"], "give --ep N alone", "--ep with --tp")
        expect_error(["run", ex, "--ep", "2", "--rank", "1"], "--ep N runs all N ranks",
                     "--ep with --rank")
        expect_error(["run", ex, "--ep", "2", "--enable-ep"], "--enable-ep", "--ep with --enable-ep")
        expect_error(["run", ex, "--ep", "2", "--ep-format", "masked"], "oracle, standard or batched",
                     "--ep-format")
        expect_error(["run", ex, "--ep", "2", "--ep-format", "batched"], "not batched",
                     "batched format with a kernel that takes only the standard one")
        expect_error(["run", ex, "--ep", "2", "--device", "cuda:1"], "--device cpu or cuda",
                     "--ep with cuda:N")
        # GPUs: none visible here (CUDA_VISIBLE_DEVICES empty), so the launcher refuses.
        expect_error(["run", ex, "--ep", "2", "--device", "cuda"], "needs 2 GPUs",
                     "--ep 2 --device cuda without GPUs", env={"CUDA_VISIBLE_DEVICES": ""})
        expect_error(["run", ex, "--ep", "2", "--ep-rank", "0", "--ep-unique-id", "zz"],
                     "NCCL", "a child rank without a valid unique id / NCCL")

        # bench --ep: CSV with the EP columns.
        p = run(["bench", ex, "--ep", "2", "--tokens", "1,16", "--csv", "--no-ceilings",
                 "--min-time", "0", "--min-reps", "2", "--max-reps", "2"])
        check(p.returncode == 0, f"bench --ep: {p.stderr[-400:]}")
        lines = p.stdout.strip().splitlines()
        head = lines[0].split(",") if lines else []
        check(head[-5:] == ["ep", "dispatch_s", "compute_s", "combine_s",
                            "communication_fraction"], f"bench --ep CSV header {head[-5:]}")
        for line in lines[1:]:
            f = dict(zip(head, line.split(",")))
            check(f["status"] == "ok" and f["ep"] == "2", f"bench --ep row {line}")
            check(0 <= float(f["communication_fraction"]) <= 1, f"bench comm fraction {line}")
            check(float(f["median_s"]) > 0 and int(f["E_local"]) == 4, f"bench row {line}")
        check(len(lines) == 3, f"bench --ep: two rows, got {len(lines) - 1}")
        p = run(["bench", ex, "--ep", "4", "--tokens", "3", "--json", "--no-ceilings",
                 "--min-time", "0", "--min-reps", "1", "--max-reps", "1"])
        check(p.returncode == 0, f"bench --ep --json: {p.stderr[-300:]}")
        if p.returncode == 0:
            rows = json.loads(p.stdout)["rows"]
            check(rows and rows[0]["ep"] == 4 and rows[0]["status"] == "ok", f"bench json {rows}")
        # A router with a correction bias (MiniMax-M2: sigmoid + bias), routed on the host by every
        # rank with the same bias: the reference kernel (the oracle has no CPU backend for it).
        p = run(["bench", "--preset", "minimax-m2-tp4", "--ep", "2", "--backend", "ref",
                 "--tokens", "2", "--json", "--no-ceilings", "--min-time", "0", "--min-reps", "1",
                 "--max-reps", "1", "--max-weight-mib", "16"])
        check(p.returncode == 0, f"bench --ep minimax: {p.stderr[-300:]}")
        if p.returncode == 0:
            rows = json.loads(p.stdout)["rows"]
            check(rows and rows[0]["status"] == "ok" and rows[0]["ep"] == 2,
                  f"bench --ep minimax row {rows}")
        expect_error(["bench", ex, "--ep", "0"], "--ep 0 must be >= 1", "bench --ep 0")
        expect_error(["bench", ex, "--ep", "9", "--no-ceilings"], "8 routed experts",
                     "bench --ep 9")
        expect_error(["bench", ex, "--ep", "2", "--tp", "2"], "--ep alone", "bench --ep --tp")

    if FAILURES:
        print(f"test_ep_cli: {len(FAILURES)} failure(s)")
        sys.exit(1)
    print("test_ep_cli: all passed")


if __name__ == "__main__":
    main()
