"""Carry fla's compiled and autotuned Triton kernels from one device call to the next.

fla autotunes every kernel over many configurations the first time it meets a head size, which
takes minutes per op; a device machine starts with an empty cache each time. After one call has
filled ``TRITON_CACHE_DIR`` (compiled binaries and ``*.autotune.json`` choices), ``pack`` writes
every cache entry that is not one of ours into one archive, and ``unpack`` restores it in a later
call. Our kernels stay out, so their time to first result is still measured from a cold cache.

    python -m tools.triton_cache pack $OUT/fla_triton_cache.tar.xz
    python -m tools.triton_cache pack /tmp/c.tar && xz -T0 /tmp/c.tar   # uncompressed, then xz on all cores
    python -m tools.triton_cache unpack fla_cache/fla_triton_cache.tar.xz
    python -m tools.triton_cache drop-autotune     # forget autotune choices, keep binaries
"""
import argparse
import os
import re
import tarfile
from pathlib import Path

KERNEL_SOURCES = Path(__file__).resolve().parent.parent / "kernels"


def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def our_kernel_names() -> set:
    """Names of the ``@triton.jit`` functions in ``kernels/``."""
    names = set()
    for path in KERNEL_SOURCES.rglob("*.py"):
        names.update(re.findall(r"@triton\.jit\s*\n\s*def (\w+)\(", path.read_text()))
    return names


def is_ours(entry: Path, ours: set) -> bool:
    stems = {f.name.split(".")[0].removeprefix("__grp__") for f in entry.iterdir()}
    return bool(stems & ours)


def pack(archive: Path) -> None:
    ours = our_kernel_names()
    entries = [d for d in cache_dir().iterdir() if d.is_dir() and not is_ours(d, ours)]
    mode = "w" if archive.suffix == ".tar" else "w:xz"
    partial = archive.with_name(archive.name + ".partial")  # a pack cut off by a time limit leaves no archive
    with tarfile.open(partial, mode) as tar:
        for entry in entries:
            tar.add(entry, arcname=entry.name)
    os.replace(partial, archive)
    print(f"packed {len(entries)} cache entries into {archive} ({archive.stat().st_size / 2**20:.1f} MiB)")


def unpack(archive: Path) -> None:
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(cache_dir(), filter="data")
    print(f"unpacked {archive} into {cache_dir()}")


def drop_autotune() -> None:
    files = list(cache_dir().rglob("*.autotune.json"))
    for f in files:
        f.unlink()
    print(f"dropped {len(files)} autotune results")


def shorten_autotune(warmup_ms: float = 5, rep_ms: float = 20) -> None:
    """Let every Triton autotuner in this process time each configuration for ``rep_ms`` instead
    of 100 ms (same search space, same median; fla's kernels run 0.05 - 5 ms, so still tens of
    repetitions). Five times less device time on fla's first call at a new head size."""
    import triton.testing
    from triton.runtime.autotuner import Autotuner

    def bench(self):
        return lambda kernel_call, quantiles: triton.testing.do_bench(
            kernel_call, warmup=warmup_ms, rep=rep_ms, quantiles=quantiles)

    Autotuner.do_bench = property(bench)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["pack", "unpack", "drop-autotune"])
    p.add_argument("archive", nargs="?", type=Path)
    args = p.parse_args()
    if args.action == "drop-autotune":
        drop_autotune()
    elif args.archive is None:
        p.error(f"{args.action} needs an archive path")
    else:
        (pack if args.action == "pack" else unpack)(args.archive)


if __name__ == "__main__":
    main()
