"""Fill the MQAR table over many device windows: what a run's state needs to cross from one call to the next.

A device call runs at most 10 minutes and a session has about 25 minutes of device time, while a
run at L = 2048 takes about an hour; so runs are carried across calls and sessions:
  * finished runs travel as their record, ``benchmarks/results/mqar_zoology/runs/<run id>.json``
    (tracked: every call sees them, ``restore`` marks them DONE and the workers skip them);
  * unfinished runs travel as their last per-epoch checkpoint, packed into ``ckpt.tar.NN`` parts
    that come back from a call and go to the next one in the git-ignored folder ``.mqar_carry``.
    A checkpoint holds the weights and AdamW's two moments in fp32, about 19 MiB at 1.65M
    parameters; what comes back from a call (8 files, 16 MiB each, 64 MiB in all) and what travels
    to one (64 MiB with the tree) leave room for two (``--carry-mib 40``): runs that have left
    chance, then the runs with the most training done, are packed first, and a run left out restarts
    at epoch 0 later (its curve so far stays in its record, marked unfinished). Within a session a
    warm machine keeps ``.mqar`` between calls, so there every unfinished run resumes anyway.

One session (the device runner; ``benchmarks/README.md`` has the same steps):
  1. a device call from the repository root, with ``.mqar_carry`` carried, ``timeout_s`` 600:
         bash tools/mqar_device.sh tools/mqar_queue.txt
     (``restore``, then ``RUNS_PER_GPU`` runs per GPU until ``DEADLINE_S`` = 540 s, then the report
     and ``export``: ``mqar_results.md``, ``progress.txt``, ``mqar_state.tgz`` and ``ckpt.tar.NN``
     come back);
  2. here, with the folder the call's files came back to:
         python -m tools.mqar_device collect FILES_AT
     (the records into ``benchmarks/results/mqar_zoology/runs``, the parts into ``.mqar_carry``,
     the report ``benchmarks/results/mqar_zoology/mqar_results.md`` and ``mqar_accuracy.png``);
  3. again from 1 while device time is left, then commit ``benchmarks/results/mqar_zoology``.
"""
import argparse
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from hdla_vision.lm import mqar_report

RESULTS = Path("benchmarks/results/mqar_zoology")
CARRY = Path(".mqar_carry")
# Test accuracy from which a run counts as learning when choosing what to carry (chance is 1 / the
# values left in play: ~0.03% at vocab 8192).
LEARNING_ACCURACY = 0.01
PART_PREFIX = "ckpt.tar."
MAX_FILES_BACK = 8
FILES_BESIDE_PARTS = 3  # mqar_results.md, progress.txt, mqar_state.tgz
MIB = 1 << 20


def read_record(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def better(new: dict, old) -> bool:
    """A finished record beats an unfinished one, then more epochs win."""
    return old is None or (new["status"] == "done", new["epochs_run"]) > (old["status"] == "done", old["epochs_run"])


# -- on the device ------------------------------------------------------------------------------
def restore(state: Path, results: Path = RESULTS, carry: Path = CARRY) -> dict:
    """Before a call's runs: mark the finished runs of ``results`` DONE in ``state``, and unpack the
    carried checkpoints of runs that ``state`` holds no later epoch of. Returns the counts."""
    state.mkdir(parents=True, exist_ok=True)
    finished = 0
    for file in sorted((results / "runs").glob("*.json")):
        record = read_record(file)
        folder = state / file.stem
        if record and record["status"] == "done" and not (folder / "DONE").exists():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "run.json").write_text(json.dumps(record, indent=1))
            (folder / "DONE").write_text(f"{record['stop_reason']}\n")
            finished += 1
    return dict(finished=finished, resumed=unpack_checkpoints(carry, state))


def unpack_checkpoints(carry: Path, state: Path) -> int:
    """Put each carried ``<run id>/ckpt.pt`` into ``state`` unless the run is DONE there or its
    ``run.json`` there already has as many epochs; returns how many were put in place. The run's record
    travels with its checkpoint (the manifest) and is put beside it where ``state`` has none, so that a
    call in which the run never writes (it crashed at start, or found no time) carries it on again."""
    parts = sorted(carry.glob(PART_PREFIX + "*"))
    if not parts:
        return 0
    data = b"".join(part.read_bytes() for part in parts)
    placed = 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
        for run, entry in manifest.items():
            record = entry if isinstance(entry, dict) else None  # older carries: {run id: epochs}
            epochs = record["epochs_run"] if record else entry
            folder = state / run
            local = read_record(folder / "run.json") if (folder / "ckpt.pt").exists() else None
            if (folder / "DONE").exists() or (local and local["epochs_run"] >= epochs):
                continue
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / ".ckpt.pt.carried"
            tmp.write_bytes(tar.extractfile(f"{run}/ckpt.pt").read())
            tmp.replace(folder / "ckpt.pt")
            if record and not (folder / "run.json").exists():
                (folder / "run.json").write_text(json.dumps(record, indent=1))
            placed += 1
    return placed


def work_done(record: dict) -> int:
    """Tokens trained so far (steps x batch x length): what a restart would lose."""
    p = record["protocol"]
    return (record["curve"][-1]["step"] if record["curve"] else 0) * p["batch_size"] * p["length"]


def learning(record: dict) -> bool:
    """Whether a run has left chance: its best test accuracy reached :data:`LEARNING_ACCURACY`."""
    return (record.get("best_accuracy") or 0.0) >= LEARNING_ACCURACY


def pick_carried(state: Path, budget_bytes: int) -> list:
    """Unfinished runs with a checkpoint, as many as fit in the budget: runs that have left chance
    first (they are the ones an early stop may soon finish; a run still at chance after several
    epochs usually trains all its epochs), then the most training done."""
    runs = []
    for ckpt in state.glob("*/ckpt.pt"):
        record = read_record(ckpt.parent / "run.json")
        if record and not (ckpt.parent / "DONE").exists():
            priority = (learning(record), work_done(record))
            runs.append((priority, ckpt.parent.name, ckpt.stat().st_size, record["epochs_run"]))
    chosen, used = [], 0
    for _, run, size, epochs in sorted(runs, reverse=True):
        if used + size <= budget_bytes:
            chosen.append((run, epochs))
            used += size
    return chosen


def export(state: Path, out: Path, carry_mib: float = 40, part_mib: float = 15, queues=()) -> dict:
    """After a call's runs: ``out/mqar_state.tgz`` (records, DONE markers, logs, the report folder),
    the chosen checkpoints as ``out/ckpt.tar.NN`` parts and ``out/progress.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "mqar_state.tgz", "w:gz") as tar:
        for path in sorted(state.rglob("*")):
            kept = path.suffix not in (".pt", ".lock", ".tmp") and "data" not in path.relative_to(state).parts
            if path.is_file() and kept:
                tar.add(path, arcname=str(path.relative_to(state)))
    max_parts = MAX_FILES_BACK - FILES_BESIDE_PARTS
    carried = pick_carried(state, int(min(carry_mib, max_parts * part_mib) * MIB))
    write_parts(state, carried, out, int(part_mib * MIB))
    text = progress(state, carried, queues)
    (out / "progress.txt").write_text(text)
    print(text)
    return dict(carried=[run for run, _ in carried])


def write_parts(state: Path, carried: list, out: Path, part_bytes: int) -> None:
    """One uncompressed tar (``manifest.json`` = {run id: its run.json record}, then ``<run id>/ckpt.pt``)
    cut into parts."""
    if not carried:
        return
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        manifest = json.dumps({run: read_record(state / run / "run.json") for run, _ in carried}).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
        for run, _ in carried:
            tar.add(state / run / "ckpt.pt", arcname=f"{run}/ckpt.pt")
    data = buffer.getvalue()
    for index, start in enumerate(range(0, len(data), part_bytes)):
        (out / f"{PART_PREFIX}{index:02d}").write_bytes(data[start:start + part_bytes])


def progress(state: Path, carried: list, queues=()) -> str:
    """Counts of finished, unfinished (carried or not) and, for the queues, not started runs."""
    done = sorted(p.parent.name for p in state.glob("*/DONE"))
    paused = sorted(p.parent.name for p in state.glob("*/ckpt.pt") if not (p.parent / "DONE").exists())
    carried_ids = {run for run, _ in carried}
    lines = [f"done: {len(done)} runs; unfinished: {len(paused)} ({len(carried_ids)} carried in ckpt.tar.*)"]
    lines += [f"unfinished, {'carried' if run in carried_ids else 'NOT carried (restarts at epoch 0)'}: {run}"
              for run in paused]
    for queue in queues:
        ids = [line.split()[0] for line in Path(queue).read_text().splitlines() if line.strip()]
        waiting = [run for run in ids if not (state / run / "run.json").exists()]
        lines.append(f"{queue}: {len(ids)} runs, {sum((state / r / 'DONE').exists() for r in ids)} done, "
                     f"{len(waiting)} not started" + (f" (next: {waiting[0]})" if waiting else ""))
    return "\n".join(lines) + "\n"


# -- here, after a call -------------------------------------------------------------------------
def collect(files: Path, results: Path = RESULTS, carry: Path = CARRY, queues=None) -> dict:
    """Take a call's files: each run's record into ``results/runs`` (where it beats the one there),
    the checkpoint parts into ``carry`` (replacing the old ones), then the report in ``results``."""
    runs = results / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    updated = 0
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(files / "mqar_state.tgz") as tar:
        tar.extractall(tmp, filter="data")
        for file in sorted(Path(tmp).glob("*/run.json")):
            record, target = read_record(file), runs / f"{file.parent.name}.json"
            if record and better(record, read_record(target)):
                target.write_text(json.dumps(record, indent=1))
                updated += 1
    carry.mkdir(parents=True, exist_ok=True)
    for old in carry.glob(PART_PREFIX + "*"):
        old.unlink()
    parts = sorted(files.glob(PART_PREFIX + "*"))
    for part in parts:
        shutil.copyfile(part, carry / part.name)
    records = mqar_report.load_runs([runs])
    if records:
        mqar_report.write_report(records, results, queues, runs_json=False)
    return dict(updated=updated, parts=len(parts), runs=len(records))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("restore", help="device, before the runs")
    r.add_argument("--state", default=".mqar")
    e = sub.add_parser("export", help="device, after the runs")
    e.add_argument("--state", default=".mqar")
    e.add_argument("--out", required=True)
    e.add_argument("--carry-mib", type=float, default=40)
    e.add_argument("--part-mib", type=float, default=15)
    e.add_argument("--queue", nargs="*", default=())
    c = sub.add_parser("collect", help="here, after a call: FILES is the folder its files came back to")
    c.add_argument("files")
    c.add_argument("--queue", nargs="*", default=None, help="the planned runs (default: Zoology's default sweep)")
    for parser in (r, c):
        parser.add_argument("--results", default=str(RESULTS))
        parser.add_argument("--carry", default=str(CARRY))
    args = p.parse_args(argv)
    if args.command == "restore":
        result = restore(Path(args.state), Path(args.results), Path(args.carry))
    elif args.command == "export":
        result = export(Path(args.state), Path(args.out), args.carry_mib, args.part_mib, args.queue)
    else:
        result = collect(Path(args.files), Path(args.results), Path(args.carry), args.queue)
    print(json.dumps(result))
    return result
