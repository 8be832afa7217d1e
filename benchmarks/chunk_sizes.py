"""chunk_hdla fwd+bwd at short sequences: the chunk16 family against the chunk64 family at 16- and
32-token chunks, in one process (issue 11: can one family serve every length?).

    python -m benchmarks.chunk_sizes [--shapes vision,v384,v512] [--out DIR]

The chunk64 variants run with ``fwd.default_chunk`` replaced by the size under test, in this process
only (the op's forward and backward both read it); the rows are printed as they are measured and
written to ``DIR/chunk_sizes.json`` with the device, date and commit.
"""
import argparse
import json
import os

import torch

from benchmarks.kernels import SHAPES, make_inputs, ours
from benchmarks.timing import time_fwd_bwd
from hdla_vision.kernels.generalized import fwd
from tools.provenance import provenance

VARIANTS = {"chunk16": ("chunk16", None), "chunk64_c16": ("chunk64", 16), "chunk64_c32": ("chunk64", 32)}


def time_variant(name: str, shape, device) -> dict:
    """fwd and fwd+bwd ms of chunk_hdla on ``shape`` with the variant's family and chunk."""
    family, chunk = VARIANTS[name]
    os.environ["HDLA_VISION_KERNELS"] = family
    default = fwd.default_chunk
    if chunk is not None:
        fwd.default_chunk = lambda *_: chunk
    try:
        t_fwd, t_all = time_fwd_bwd(ours, make_inputs(*shape, torch.bfloat16, device))
    finally:
        fwd.default_chunk = default
    return {"variant": name, "fwd_ms": t_fwd, "fwd_bwd_ms": t_all}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="vision,v384,v512")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    result = {**provenance(torch.cuda.get_device_name()), "dtype": "bfloat16", "rows": []}
    for shape_name in args.shapes.split(","):
        for name in args.variants.split(","):
            row = {"shape": shape_name, "bthd": SHAPES[shape_name], **time_variant(name, SHAPES[shape_name], device)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chunk_sizes.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
