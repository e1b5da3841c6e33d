#!/usr/bin/env python3
"""Pitfalls of spec/pitfalls.md checked at the command line (docs/PITFALLS.md has the matrix):
  25  an explicit backend that cannot support the deployment fails with one line naming the backend
      and the reason, and a non-zero exit;
  26  auto with every candidate rejected: one report listing every candidate, each with its reason,
      then vLLM's single error line (exit 2)."""
import os
import re
import subprocess
import sys

BIN = os.environ.get("FP8MOE_BIN", "build/fp8moe")
FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what)


def oracle(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    p = subprocess.run([BIN, "oracle", *args], capture_output=True, text=True, env=env, timeout=60)
    return p.returncode, p.stdout, p.stderr


def test_all_candidates_rejected_in_one_report():  # pitfall 26
    # Block FP8 on a Volta (SM70): no FP8 MoE backend fits.
    rc, out, err = oracle("select", "--platform", "cuda:70")
    check(rc == 2, f"no backend exits 2, got {rc}")
    text = out + err
    check(text.count("No FP8 MoE backend supports the deployment configuration.") == 1,
          f"vLLM's error once: {text}")
    m = re.search(r"Candidates \(priority order\): \[(.*)\]", out)
    check(m is not None, f"the candidates are listed: {out}")
    if m is None:
        return
    candidates = re.findall(r"'([A-Z0-9_]+)'", m.group(1))
    check(len(candidates) >= 3, f"several candidates: {candidates}")
    tried = out.split("Tried:", 1)
    check(len(tried) == 2, f"a Tried section: {out}")
    if len(tried) != 2:
        return
    rows = [line.split(None, 2) for line in tried[1].splitlines() if line.startswith("  ")]
    named = {r[0] for r in rows}
    for c in candidates:
        check(c in named, f"candidate {c} appears in the trace: {tried[1]}")
    for r in rows:
        check(len(r) == 3 and r[2].strip() and r[2].strip() != "supported",
              f"each rejection has a reason: {r}")


def test_explicit_backend_error_names_backend_and_reason():  # pitfall 25
    # Marlin needs SM75+: on a Volta the explicit choice raises vLLM's ValueError with the reason.
    rc, out, err = oracle("select", "--platform", "cuda:70", "--moe-backend", "marlin")
    check(rc == 2, f"explicit unsupported backend exits 2, got {rc}")
    line = [l for l in err.splitlines() if "MARLIN" in l]
    check(len(line) == 1, f"one error line naming MARLIN: {err!r}")
    if line:
        check("does not support the deployment configuration since" in line[0],
              f"the reason is given: {line[0]}")


def main():
    test_all_candidates_rejected_in_one_report()
    test_explicit_backend_error_names_backend_and_reason()
    if FAILURES:
        print(f"{len(FAILURES)} failure(s)")
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
