"""Join the ``fla_seed.json`` written by several processes of ``python -m benchmarks.fla_seed`` (one
mixer per GPU, possibly over several device calls) into one JSON.

    python -m benchmarks.fla_seed --merge-from DIR ... --out OUT_DIR
"""
import json
import os


def merge(folders, out):
    """One JSON from the ``fla_seed.json`` of several processes (same device and versions); the
    commit each mixer ran at goes to ``commits`` (runs of one comparison may span device calls)."""
    merged = None
    for folder in folders:
        with open(os.path.join(folder, "fla_seed.json")) as f:
            part = json.load(f)
        part["commits"] = {name: part["commit"] for name in part["fla_kernels"]}
        if merged is None:
            merged = part
            continue
        for key in ("device", "torch", "triton", "fla", "scale"):
            if part[key] != merged[key]:
                raise ValueError(f"--merge-from: {folder} has {key}={part[key]!r}, the first has {merged[key]!r}")
        for key in ("fla_kernels", "parity", "timings_ms", "commits"):
            merged[key].update(part[key])
        merged["fla_gated_bwd_forced_for"] += part["fla_gated_bwd_forced_for"]
    merged["fla_gated_bwd_forced_for"] = list(dict.fromkeys(merged["fla_gated_bwd_forced_for"]))
    merged.pop("commit")
    with open(os.path.join(out, "fla_seed.json"), "w") as f:
        json.dump(merged, f, indent=1)
    print(f"merged {len(folders)} results into {out}/fla_seed.json")
