"""Issue #67's table (docs/RESULTS.md section 5): RULER with the kept K/V stored in 16 / 8 / 4
bits; each row's paired gap to the same policy at 16 bits (RESULTS 3's own records), and the gate
against TOVA at the same bits. At 4k (``--length 4096``) the folders end in ``_4k``.

    python experiments/summarize_kvbits.py [--length 4096]
"""

from __future__ import annotations

import argparse
import json

from kvgate.eval.paired import paired_difference

R = "experiments/results/ruler/"
FAMILIES = ("niah_single_1", "niah_single_2")


def rows(folder: str, policy: str, budget: str | None = None, length: int = 2048) -> list[dict]:
    """The two families' records of ``policy`` (at ``budget``) in a results folder."""
    with open(R + folder + "/results.json") as f:
        results = json.load(f)["results"]
    out = []
    for fam in FAMILIES:
        keys = [k for k in results if k.startswith(f"ruler|{fam}@{length}|{policy}|")
                and (budget is None or k.split("|")[3] == budget)]
        if len(keys) != 1:
            raise KeyError(f"{folder}: {fam} {policy} {budget}: {keys}")
        out.append(results[keys[0]])
    return out


def score(records: list[dict]) -> str:
    acc = sum(r["acc"] for r in records) / len(records)
    evict = sum(r["evict_pct"] for r in records) / len(records)
    return f"{acc:.1f} (n {sum(r['n'] for r in records)}, %Evict {evict:.0f})"


def gap(a: list[dict], b: list[dict]) -> str:
    g = paired_difference(a, b)
    return f"{g['diff']:+.1f} [{g['ci_low']:+.1f}, {g['ci_high']:+.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=2048)
    n = parser.parse_args().length
    sfx = "" if n == 2048 else "_4k"
    at16 = {"full": rows("powered" + sfx, "full", length=n),
            "tova": rows("powered" + sfx, "tova", "0.5", length=n),
            "gate": rows("powered_cpt_kvzap" + sfx, "local_gate", length=n)}
    print("| policy | 16 bits | 8 bits, vs 16 | 4 bits, vs 16 |")
    print("|---|---|---|---|")
    found = {}
    for name in ("full", "gate", "tova"):
        cells = [score(at16[name])]
        for bits in (8, 4):
            folder = f"kvbits{bits}" + ("_cpt_kvzap" if name == "gate" else "") + sfx
            policy = "local_gate" if name == "gate" else name
            try:
                got = rows(folder, policy, "0.5" if name == "tova" else None, n)
            except (FileNotFoundError, KeyError):
                cells.append("-")
                continue
            found[name, bits] = got
            cells.append(f"{score(got)}, {gap(got, at16[name])}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for bits in (8, 4):
        if ("gate", bits) in found and ("tova", bits) in found:
            print(f"gate - TOVA at {bits} bits: {gap(found['gate', bits], found['tova', bits])}")


if __name__ == "__main__":
    main()
