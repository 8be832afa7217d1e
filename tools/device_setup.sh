# Source at the start of a device command: installs carried wheels (.whl/) and this checkout.
set -e
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
# --no-deps keeps the image's packages: one older than pyproject.toml asks for (the image's timm lacked
# timm.models._input on 2026-11-28) breaks every import below, so say it once, here, with the fix
python3 -c "import hdla_vision" 2>/tmp/hdla_import_error.txt || {
  echo "device_setup: import hdla_vision fails on this machine (carry the missing or newer packages as wheels in .whl,"
  echo "e.g. pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl timm==1.0.31):"
  tail -n 3 /tmp/hdla_import_error.txt
} >&2
export PYTHONUNBUFFERED=1
set +e
# stamp MESSAGE: appends "HH:MM:SS MESSAGE" to $OUT/timeline.txt (the device scripts' record of each stage).
stamp() { echo "$(date +%T) $*" >> "$OUT/timeline.txt"; }
# pack: at most 8 files come back from $OUT; keep summary.txt and timeline.txt, pack the rest into results.tgz.
pack() {
  (cd "$OUT" && tar czf /tmp/results.tgz --exclude summary.txt --exclude timeline.txt . && mv /tmp/results.tgz . \
    && find . -maxdepth 1 -type f ! -name results.tgz ! -name summary.txt ! -name timeline.txt -delete \
    && find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +)
}
# warm_models SECONDS "MODELS" "RESOLUTIONS" [benchmarks.models flags ...]: in the background, one benchmarks.models
# process per (model, resolution) with 1 ms timings, so that its compilations (Triton, inductor) fill the caches side
# by side (compiling is CPU-bound) before a timed run; then `wait` for them and `rm -rf "$OUT"/warm_*`. WARM_TAG
# (optional) names the outputs apart where the same cells warm under several settings (an environment variable
# set for the call, e.g. `HDLA_VISION_KERNELS=chunk16 WARM_TAG=chunk16 warm_models ...`).
warm_models() {
  local limit=$1 models=$2 resolutions=$3 model res name
  shift 3
  for model in $models; do
    for res in $resolutions; do
      name=warm_${WARM_TAG:+${WARM_TAG}_}${model}_$res
      (timeout "$limit" nice -n 10 python3 -m benchmarks.models --models "$model" --resolutions "$res" "$@" \
         --warmup-ms 1 --rep-ms 1 --out "$OUT/$name" > "$OUT/$name.txt" 2>&1
       stamp "$name done (rc $?)") &
    done
  done
}
