# Source at the start of a device command: installs carried wheels (.whl/) and this checkout.
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
export PYTHONUNBUFFERED=1
set +e
# stamp MESSAGE: appends "HH:MM:SS MESSAGE" to $OUT/timeline.txt (the device scripts' record of each stage).
stamp() { echo "$(date +%T) $*" >> "$OUT/timeline.txt"; }
