# Device call (H100, < 420 s): the fused prologue under the rest of the GPU checks. The CPU and CUDA paths of
# hdla_tiny agree (tests/test_backbone.py -m gpu); hdla_tiny and gla_tiny compile to one
# graph on CUDA with inductor and equal eager (tools.compile_models). Writes $OUT/check.txt, compile_models.json.
source tools/device_setup.sh
out="$OUT/check.txt"
timeout 120 python3 -m pytest -q -m gpu tests/test_backbone.py > "$OUT/backbone.txt" 2>&1; echo "backbone gpu tests rc $?" >> "$out"
tail -2 "$OUT/backbone.txt" >> "$out"
timeout 280 python3 -m tools.compile_models --device cuda --img-size 224 --backend inductor --models hdla_tiny gla_tiny --out "$OUT" >> "$out" 2>&1
echo "compile_models rc $?" >> "$out"
cat "$out"
