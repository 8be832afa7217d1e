"""Where a benchmark's numbers come from: the device, the date and the commit, for its JSON."""
import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def current_commit() -> str:
    """``$COMMIT`` (set by the device scripts: the device copy has no ``.git``), else git's short HEAD,
    else ``"unknown"``."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def provenance(device: str) -> dict:
    """``{"device", "date", "commit"}``: the first keys of every benchmark JSON."""
    return {"device": device, "date": datetime.date.today().isoformat(), "commit": current_commit()}
