# Device call (H100, < 200 s): the host's share of one block's fwd+bwd (benchmarks.host_profile): host time
# per step with the device kept busy, do_bench time, and cProfile's top functions; hdla_tiny at 224 px
# (chunk16 and chunk64) and 2048 px, deit_tiny beside. Writes $OUT/host.txt.
source tools/device_setup.sh
run() { echo "== $*" >> "$OUT/host.txt"; timeout 100 python3 -m benchmarks.host_profile "$@" >> "$OUT/host.txt" 2>&1; }
run --model hdla_tiny --res 2048 --batch 2
run --model hdla_tiny --res 224 --batch 256 --family chunk16
run --model hdla_tiny --res 224 --batch 256 --rows 25
run --model deit_tiny_patch16_224 --res 224 --batch 256 --rows 5
grep -E "^==|host .* ms per step|synchronising" "$OUT/host.txt"
