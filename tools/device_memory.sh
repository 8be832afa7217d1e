# Device call (H100, one call, <= 480 s, about 5 min expected): peak training memory and step time of hdla_tiny,
# gla_tiny, gdn_tiny, kda_tiny and deit_tiny at 224, 512, 1024 and 2048 px (batch 256 / 64 / 16 / 2), eager, bf16
# autocast, the kernel family the ops choose by default, with the mixers' recomputed stages on and off (issue 12
# part 4).
# Usage on the device, repository root (carry .whl):
#   bash tools/device_memory.sh
# Writes under $OUT:
#   warm_<model>.txt  each linear model trained once per resolution beforehand, in its own niced process, all four
#                     at once (fills Triton's on-disk cache, so that no measured first call compiles; not the result)
#   on_<res>.txt, on_<res>/models.json
#                     benchmarks.models at one resolution, the five models, recomputed stages on (the default)
#   off_<res>.txt, off_<res>/models.json
#                     the four linear models with --no-activation-recompute, right after on_<res> (deit_tiny is timm's
#                     own block, which the switch does not touch)
#   summary.txt       per model and resolution: step ms and peak MiB with the stages recomputed and saved, and
#                     their ratios to deit_tiny's
#   timeline.txt      start / end of each part
# Each cell's step time is do_bench's median over >= 2 timed steps (--rep-ms 600: 2-6 steps at 224 px, more at the
# other sizes); each cell is printed as one JSON line when measured, so a part cut by its timeout keeps its rows.
# The predicted saved bytes (python -m tools.saved_memory --whole) need no GPU: run them on a CPU.
source tools/device_setup.sh
LINEAR="hdla_tiny gla_tiny gdn_tiny kda_tiny"
stamp "start"
for model in $LINEAR; do
  (timeout 120 nice -n 10 python3 -m benchmarks.models --models "$model" --modes train \
     --resolutions 224 512 1024 2048 --warmup-ms 1 --rep-ms 1 --out "$OUT/warm_$model" > "$OUT/warm_$model.txt" 2>&1
   stamp "warm $model done (rc $?)") &
done
wait
stamp "warm-up done"
bench() {  # bench NAME RES SECONDS ARGS...: one benchmarks.models training run at one resolution into $OUT/NAME
  local name=$1 res=$2 seconds=$3; shift 3
  timeout "$seconds" python3 -m benchmarks.models --modes train --resolutions "$res" --warmup-ms 1 --rep-ms 600 \
    --out "$OUT/$name" "$@" > "$OUT/$name.txt" 2>&1
  stamp "$name done (rc $?)"
}
for res in 224 512 1024 2048; do
  bench "on_$res" "$res" 45 --models $LINEAR deit_tiny_patch16_224
  bench "off_$res" "$res" 40 --models $LINEAR --no-activation-recompute
done
stamp "end"
rm -rf "$OUT"/warm_*/
python3 - "$OUT" > "$OUT/summary.txt" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
cells = {}
for path in sorted(out.glob("o*_*.txt")):
    setting = path.name.split("_")[0]
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            cells[row["model"], row["resolution"], setting] = row
print(f"{'model':<24}{'res':>6}{'ms on':>9}{'ms off':>9}{'MiB on':>9}{'MiB off':>9}{'/deit ms on':>13}"
      f"{'/deit ms off':>13}{'/deit MiB on':>14}{'/deit MiB off':>15}")
for model, res in sorted({(m, r) for m, r, _ in cells}, key=lambda k: (k[1], k[0])):
    base = cells.get(("deit_tiny_patch16_224", res, "on"), {})
    cols = []
    for key in ("step_ms", "peak_mem_mib"):
        cols += [cells.get((model, res, s), {}).get(key, cells.get((model, res, s), {}).get("error")) for s in ("on", "off")]
    for key in ("step_ms", "peak_mem_mib"):
        cols += [round(c / base[key], 2) if isinstance(c, float) and key in base else None
                 for c in [cells.get((model, res, s), {}).get(key) for s in ("on", "off")]]
    print(f"{model:<24}{res:>6}" + "".join(f"{'' if c is None else c:>{w}}" for c, w in zip(cols, (9, 9, 9, 9, 13, 13, 14, 15))))
EOF
cat "$OUT/timeline.txt" "$OUT/summary.txt"
